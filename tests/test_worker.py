"""The sync worker's contract, in-process, on every backend.

Handlers run on real worker threads against a real database; deliveries are counted in lists
(a set would hide duplicates). Faults with real processes are in ``test_worker_faults.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from sqla_delayedq import (
    Buried,
    DelayedMessage,
    DelayedQueue,
    Delivery,
    Envelope,
    ExponentialBackoff,
    HandlerMisuse,
    InvalidArgument,
    MessageInfo,
    NackOutcome,
    State,
    TransientError,
    WorkerError,
    _skew,
)
from sqla_delayedq._dialects import PostgreSQLStrategy
from sqla_delayedq._wakeup import parse as parse_wake
from sqla_delayedq._wakeup import payload as wake_payload
from sqla_delayedq.testing import (
    Drained,
    ManualClock,
    assert_not_offered,
    drain,
    drain_async,
)
from sqla_delayedq.worker import Worker, WorkerHooks
from tests.fix_queue import record_sql
from tests.fix_workers import AsyncRunner, losing_a_commit_reply, running, stopped_by, waiting

MODES = ("lease", "transactional")
DEAD = NackOutcome.DEAD


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def utcnow() -> datetime:
    return datetime.now(UTC)


class RecordingHooks(WorkerHooks):
    """Everything the worker reports, in order."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.processed_: list[tuple[str, str, float]] = []
        self.failed_: list[tuple[str, str, int, BaseException, NackOutcome]] = []
        self.redelivered_: list[tuple[str, str]] = []
        self.buried_: list[tuple[str, Buried]] = []
        self.lags: list[tuple[str, float]] = []
        self.db_errors: list[BaseException] = []

    def processed(self, queue: str, envelope: Envelope[Any], seconds: float) -> None:
        with self.lock:
            self.processed_.append((queue, envelope.key, seconds))

    def failed(
        self, queue: str, envelope: Envelope[Any], error: BaseException, outcome: NackOutcome
    ) -> None:
        with self.lock:
            self.failed_.append((queue, envelope.key, envelope.attempt, error, outcome))

    def redelivered(self, queue: str, envelope: Envelope[Any]) -> None:
        with self.lock:
            self.redelivered_.append((queue, envelope.key))

    def buried(self, queue: str, buried: Buried) -> None:
        with self.lock:
            self.buried_.append((queue, buried))

    def lag(self, queue: str, seconds: float) -> None:
        with self.lock:
            self.lags.append((queue, seconds))

    def db_error(self, error: BaseException) -> None:
        with self.lock:
            self.db_errors.append(error)


def pending(backend: Any, q: DelayedQueue[Any]) -> int:
    with backend.Session() as s:
        return q.counts(s).pending


def offer(backend: Any, q: DelayedQueue[Any], key: str, payload: Any = None, **kw: Any) -> None:
    with backend.Session() as s, s.begin():
        q.offer(s, key, payload if payload is not None else {}, **kw)


# -- exactly once -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_each_message_is_handled_exactly_once(backend, mode, make_worker):
    total = 200
    q: DelayedQueue[Any] = DelayedQueue(f"once-{mode}")
    with backend.Session() as s, s.begin():
        q.offer_batch(s, [(f"m{i:04d}", {"i": i}) for i in range(total)])
    delivered: list[str] = []  # a list: a duplicate must show
    lock = threading.Lock()

    def lease_handler(env: Envelope[Any]) -> None:
        with lock:
            delivered.append(env.key)

    def transactional_handler(env: Envelope[Any], session: Session) -> None:
        assert session.in_transaction()
        lease_handler(env)

    hooks = RecordingHooks()
    worker = make_worker(backend, concurrency=4, poll_interval=0.1, listen=False, hooks=hooks)
    worker.register(q, lease_handler if mode == "lease" else transactional_handler, mode=mode)
    with running(worker):
        assert wait_for(lambda: len(delivered) >= total and pending(backend, q) == 0, 60, 0.05)
    duplicates = {k: n for k, n in Counter(delivered).items() if n > 1}
    assert duplicates == {}
    assert sorted(delivered) == [f"m{i:04d}" for i in range(total)]
    assert len(hooks.processed_) == total
    assert hooks.failed_ == [] and hooks.redelivered_ == []


#: Payloads that are JSON strings, some of which read as other JSON when parsed again.
ODD_PAYLOADS = ["3", "[1]", '{"a": 1}', "x", "", "null", "true", "caf\u00e9"]


@pytest.mark.parametrize("mode", MODES)
def test_json_strings_reach_their_handler_as_offered(backend, mode, make_worker):
    """Regression: a payload that is a JSON string was decoded a second time on read, so "3"
    reached the handler as 3 and "x" was buried as corrupt JSON without its handler running."""
    q: DelayedQueue[Any] = DelayedQueue(f"strings-{mode}")
    with backend.Session() as s, s.begin():
        q.offer(s, "single", "3")
        q.offer_batch(s, [(f"s{i}", p) for i, p in enumerate(ODD_PAYLOADS)])
    got: list[tuple[str, Any]] = []
    lock = threading.Lock()

    def handler(env: Envelope[Any], session: Session | None = None) -> None:
        with lock:
            got.append((env.key, env.payload))

    hooks = RecordingHooks()
    worker = make_worker(backend, concurrency=2, poll_interval=0.1, listen=False, hooks=hooks)
    worker.register(q, handler, mode=mode)
    total = len(ODD_PAYLOADS) + 1
    with running(worker):
        assert wait_for(lambda: len(got) >= total and pending(backend, q) == 0, 30, 0.05)
    expected = [("single", "3"), *((f"s{i}", p) for i, p in enumerate(ODD_PAYLOADS))]
    assert sorted(got) == sorted(expected)
    assert hooks.failed_ == []
    with backend.Session() as s:
        assert q.counts(s).dead == 0


# -- failures ---------------------------------------------------------------------------------


def _failing_handler(mode: str, seen: list[int]) -> Callable[..., None]:
    def handler(env: Envelope[Any], session: Session | None = None) -> None:
        seen.append(env.attempt)
        raise ValueError(f"boom on attempt {env.attempt}")

    if mode == "lease":
        return lambda env: handler(env)
    return handler


@pytest.mark.parametrize("mode", MODES)
def test_a_message_a_take_buries_reaches_the_hooks_and_the_dead_counter(backend, mode, make_worker):
    """A take buries a message whose attempts are used up (here: failed under a higher
    max_attempts) or whose payload cannot be decoded: dead, no handler ran. The hooks heard
    nothing of it, so ``delayedq_dead_total`` missed the poison messages operators alert on."""
    from prometheus_client import CollectorRegistry

    from sqla_delayedq.metrics import CompositeHooks, PrometheusHooks

    generous: DelayedQueue[Any] = DelayedQueue("bury", retry=ExponentialBackoff(max_attempts=5))
    strict: DelayedQueue[Any] = DelayedQueue("bury", retry=ExponentialBackoff(max_attempts=1))
    now = utcnow()
    with backend.Session() as s, s.begin():
        generous.offer(s, "ok", {"n": 0}, now - timedelta(seconds=30))
        generous.offer(s, "used-up", {"n": 1}, now - timedelta(seconds=20))
        generous.offer(s, "poison", {"n": 2}, now - timedelta(seconds=10))
        generous.offer(s, "after", {"n": 3}, now - timedelta(seconds=5))
        s.execute(
            sa.update(cast(sa.Table, DelayedMessage.__table__))
            .where(DelayedMessage.__table__.c.key == "poison")
            .values(payload_type="other")
        )
    with backend.Session() as s, s.begin():
        envs = generous.try_poll_many(s, 2)
        assert [e.key for e in envs] == ["ok", "used-up"]
        assert generous.nack(s, envs[1], "boom", now - timedelta(seconds=20)) is (
            NackOutcome.RETRY_SCHEDULED
        )
        assert generous.release(s, envs[0])
    got: list[str] = []
    hooks = RecordingHooks()
    registry = CollectorRegistry()
    both = CompositeHooks(hooks, PrometheusHooks(registry))
    worker = make_worker(backend, concurrency=1, poll_interval=0.1, listen=False, hooks=both)
    worker.register(
        strict,
        (lambda env: got.append(env.key))
        if mode == "lease"
        else (lambda env, s: got.append(env.key)),
        mode=mode,
    )
    with running(worker):
        assert wait_for(lambda: len(got) == 2 and len(hooks.buried_) == 2, 30, 0.05)
    assert sorted(got) == ["after", "ok"]
    assert hooks.failed_ == []
    buried = sorted(b for _, b in hooks.buried_)
    assert [(b.queue, b.key) for b in buried] == [("bury", "poison"), ("bury", "used-up")]
    assert "DecodeError" in buried[0].error
    assert buried[1].error.startswith("no attempt left: 1 attempts were counted")
    assert all(q == "bury" for q, _ in hooks.buried_)
    assert registry.get_sample_value("delayedq_dead_total", {"queue": "bury"}) == 2
    assert registry.get_sample_value("delayedq_failed_total", {"queue": "bury"}) is None
    with backend.Session() as s:
        assert strict.counts(s).dead == 2


@pytest.mark.parametrize("mode", MODES)
def test_a_handler_exception_is_a_nack_with_the_error_text(backend, mode, make_worker):
    retry = ExponentialBackoff(max_attempts=5, initial=timedelta(hours=1), jitter=0)
    q: DelayedQueue[Any] = DelayedQueue("nack", retry=retry)
    offer(backend, q, "bad")
    seen: list[int] = []
    hooks = RecordingHooks()
    worker = make_worker(backend, concurrency=1, poll_interval=0.1, listen=False, hooks=hooks)
    worker.register(q, _failing_handler(mode, seen), mode=mode)
    before = utcnow()
    with running(worker):
        assert wait_for(lambda: len(hooks.failed_) == 1, 10)
        time.sleep(0.3)  # a second take would show now
    assert seen == [1]
    (_, key, attempt, error, outcome) = hooks.failed_[0]
    assert (key, attempt, outcome) == ("bad", 1, NackOutcome.RETRY_SCHEDULED)
    assert isinstance(error, ValueError)
    with backend.Session() as s:
        info = q.get(s, "bad")
    assert info is not None
    assert info.status == "pending" and info.lock_token is None
    assert info.attempts == 1
    assert info.last_error is not None and "ValueError: boom on attempt 1" in info.last_error
    assert info.last_attempt_at is not None and info.last_attempt_at >= before - timedelta(1)
    assert info.scheduled_at is not None
    assert info.scheduled_at >= before + timedelta(minutes=59)


LATEST = datetime.max.replace(tzinfo=UTC)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("policy", "attempts", "due"),
    [
        # Capped at an hour: 2.0 ** 1024 is past a float, which raised OverflowError.
        (ExponentialBackoff(max_attempts=2000, jitter=0), 1024, timedelta(hours=1)),
        # A retry past year 9999 (now + delay raised OverflowError) is due at the last time.
        (
            ExponentialBackoff(initial=timedelta(days=3_000_000), maximum=timedelta.max, jitter=0),
            0,
            None,
        ),
    ],
    ids=["attempt-1025", "past-year-9999"],
)
def test_a_backoff_past_what_floats_and_datetimes_hold_schedules_the_retry(
    backend, mode, policy, attempts, due
):
    """A valid ExponentialBackoff stopped the worker at the failure it could not compute; in
    transactional mode that rolled the take back, uncounted, for every worker in turn."""
    q: DelayedQueue[Any] = DelayedQueue("far", retry=policy)
    offer(backend, q, "bad")
    with backend.Session() as s, s.begin():
        s.execute(sa.update(DelayedMessage).values(attempts=attempts))
    seen: list[int] = []
    worker = Worker(backend.Session).register(q, _failing_handler(mode, seen), mode=mode)
    before = utcnow()
    assert worker.process_due() == 1
    assert seen == [attempts + 1] and worker.failure is None
    with backend.Session() as s:
        info = q.get(s, "bad")
    assert info is not None and info.status == "pending" and info.lock_token is None
    assert info.attempts == attempts + 1 and info.scheduled_at is not None
    if due is None:
        assert info.scheduled_at == LATEST
    else:
        assert before + due <= info.scheduled_at <= utcnow() + due


def test_a_backoff_refuses_what_it_cannot_compute():
    bad: list[dict[str, Any]] = [
        {"multiplier": float("nan")},
        {"multiplier": float("inf")},
        {"max_attempts": 2.5},
        {"max_attempts": "5"},
        {"max_attempts": True},
        {"initial": 5},
        {"jitter": None},
    ]
    for kwargs in bad:
        with pytest.raises(InvalidArgument):
            ExponentialBackoff(**kwargs)
    assert ExponentialBackoff(max_attempts=10_000, jitter=0).delay(9_999) == timedelta(hours=1)
    zero = ExponentialBackoff(initial=timedelta(0), max_attempts=10_000)
    assert zero.delay(9_999) == timedelta(0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["thread", "asyncio"])
def test_a_message_that_keeps_failing_is_dead_after_max_attempts(backend, mode, kind, clock):
    """Retries until dead, without sleeping: the testing helpers drain the worker's own
    ``process_due`` and move the queue's clock to each retry."""
    retry = ExponentialBackoff(max_attempts=3, initial=timedelta(minutes=1), jitter=0)
    q: DelayedQueue[Any] = DelayedQueue("dies", retry=retry, clock=clock)
    offer(backend, q, "bad")
    seen: list[int] = []
    hooks = RecordingHooks()
    handler = _failing_handler(mode, seen)
    if kind == "thread":
        worker = Worker(backend.Session, hooks=hooks).register(q, handler, mode=mode)
        result = drain(worker, clock=clock)
    else:
        runner = AsyncRunner(backend, hooks=hooks).register(q, handler, mode=mode)

        async def main() -> Drained:
            try:
                return await drain_async(runner.worker, clock=clock)
            finally:
                await runner.engine.dispose()

        result = asyncio.run(main())
    assert seen == [1, 2, 3]
    assert (result.handled, len(result.failures)) == (3, 3)
    assert [f[4] for f in hooks.failed_] == [
        NackOutcome.RETRY_SCHEDULED,
        NackOutcome.RETRY_SCHEDULED,
        NackOutcome.DEAD,
    ]
    assert_not_offered(q, backend.engine, key="bad")
    with backend.Session() as s:
        info = q.get(s, "bad")
        counts = q.counts(s)
    assert info is not None
    assert (info.status, info.attempts, info.scheduled_at) == ("dead", 3, None)
    assert info.last_error is not None and "ValueError: boom on attempt 3" in info.last_error
    assert (counts.dead, counts.pending) == (1, 0)


def test_a_failing_transactional_handler_runs_at_most_max_attempts_times(backend, make_worker):
    """Each failed run counts: no other thread may take the message before its failure is
    recorded and run it again under the same attempt number."""
    retry = ExponentialBackoff(max_attempts=2, initial=timedelta(milliseconds=10), jitter=0)
    q: DelayedQueue[Any] = DelayedQueue("attempts", retry=retry)
    keys = [f"bad{i}" for i in range(5)]
    with backend.Session() as s, s.begin():
        q.offer_batch(s, [(k, {}) for k in keys])
    runs: list[tuple[str, int]] = []
    lock = threading.Lock()

    def handler(env: Envelope[Any], session: Session) -> None:
        with lock:
            runs.append((env.key, env.attempt))
        raise ValueError("always")

    worker = make_worker(backend, concurrency=4, poll_interval=0.02, listen=False)
    worker.register(q, handler, mode="transactional")
    with running(worker):
        assert wait_for(lambda: pending(backend, q) == 0, 60, 0.05)
    repeated = {run: n for run, n in Counter(runs).items() if n > 1}
    assert repeated == {}, "an attempt ran again before its failure was recorded"
    assert sorted(runs) == sorted((k, a) for k in keys for a in (1, 2))


@pytest.mark.parametrize("old_fails", [False, True], ids=["old-succeeds", "old-fails"])
def test_a_message_replaced_in_flight_is_settled_by_each_delivery_s_own_handler(
    backend, make_worker, old_fails
):
    """An offer replaces a message while its handler runs. The new version waits for the old
    delivery to end (never handled beside it), then runs as a first delivery; each delivery is
    settled by its own handler. (The worker once kept one entry per row and settled the old
    handler's outcome with the new delivery's token: the old ack deleted the new version, or the
    old failure was recorded on it. Before the hold, the new version also ran beside the old.)"""
    retry = ExponentialBackoff(max_attempts=1, initial=timedelta(hours=1), jitter=0)
    q: DelayedQueue[Any] = DelayedQueue("replaced", lease=timedelta(seconds=30), retry=retry)
    offer(backend, q, "K", {"v": 1})
    old_running, replaced = threading.Event(), threading.Event()
    ran: list[tuple[str, int]] = []

    def handler(env: Envelope[Any]) -> None:
        v = env.payload["v"]
        ran.append(("start", v))
        if v == 1:
            old_running.set()
            assert replaced.wait(30)
            time.sleep(0.5)  # the other consumer polls meanwhile: the new version is held
            ran.append(("end", v))
            if old_fails:
                raise RuntimeError("the old version failed")
            return
        assert env.delivery is Delivery.FIRST and env.attempt == 1
        ran.append(("end", v))
        if not old_fails:
            raise RuntimeError("the new version failed, and must be retried")

    hooks = RecordingHooks()
    worker = make_worker(backend, concurrency=2, poll_interval=0.05, listen=False, hooks=hooks)
    worker.register(q, handler)
    settled = 2 if old_fails else 1  # an ack refused as superseded is logged, not a hook
    with running(worker):
        assert old_running.wait(30)
        offer(backend, q, "K", {"v": 2})  # REPLACE while in flight
        replaced.set()
        assert wait_for(lambda: len(hooks.processed_) + len(hooks.failed_) >= settled, 30)
    assert ran == [("start", 1), ("end", 1), ("start", 2), ("end", 2)]
    with backend.Session() as s:
        info = q.get(s, "K")
    if old_fails:  # the old failure is refused; the new version's success acknowledges it
        assert info is None
        assert [f[4] for f in hooks.failed_] == [NackOutcome.STALE]
        assert len(hooks.processed_) == 1
    else:  # the old ack is refused; the new version's failure is recorded on it
        assert info is not None and info.payload == {"v": 2}
        assert info.state is State.DEAD and "new version failed" in (info.last_error or "")
        assert hooks.processed_ == []


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("raised", [SystemExit, KeyboardInterrupt], ids=["exit", "interrupt"])
def test_a_handler_raising_a_base_exception_stops_the_worker_loudly(
    backend, make_worker, mode, raised
):
    """``sys.exit()`` in a library, a ``KeyboardInterrupt``: not an ``Exception``, so it ended
    its consumer without a word. The worker ran on with no consumer (``failure`` None), and in
    lease mode the heartbeat kept the message leased for ever, no attempt counted. Now the
    worker stops with the error and the attempt is recorded; in transactional mode too, after
    the rollback: uncounted, the message stopped every next worker at once and never died."""
    # A retry an hour away: a slow stop must not let it fall due before the state is read.
    retry = ExponentialBackoff(initial=timedelta(hours=1), jitter=0)
    q: DelayedQueue[Any] = DelayedQueue("base-exc", lease=timedelta(seconds=1), retry=retry)
    offer(backend, q, "poison")
    runs: list[str] = []

    def handler(env: Envelope[Any], session: Session | None = None) -> None:
        runs.append(env.key)
        raise raised("the handler bails out")

    worker = make_worker(backend, concurrency=1, poll_interval=0.02, listen=False)
    worker.register(q, handler, mode=mode)
    error = stopped_by(worker, lambda: bool(runs))
    assert isinstance(error, raised)
    assert runs == ["poison"]  # once: the worker stopped instead of looping or leasing it
    with backend.Session() as s:
        info = q.get(s, "poison")
    assert info is not None and info.lock_token is None  # not held by a lease
    assert info.state is State.SCHEDULED  # a failed attempt: scheduled for its retry
    assert info.attempts == 1 and raised.__name__ in (info.last_error or "")


def interrupt_once(monkeypatch: pytest.MonkeyPatch, cls: Any, name: str, raised: Any) -> list[str]:
    """Make ``cls.name`` raise ``raised`` once, after it ran (what it did stands), as an
    interruption landing in the round trip of its reply; returns a list that says it fired."""
    real = getattr(cls, name)
    fired: list[str] = []

    def interrupted(*args: Any, **kw: Any) -> Any:
        result = real(*args, **kw)
        if not fired:
            fired.append(name)
            raise raised("interrupted")
        return result

    monkeypatch.setattr(cls, name, interrupted)
    return fired


@pytest.mark.parametrize("raised", [KeyboardInterrupt, SystemExit], ids=["interrupt", "exit"])
def test_an_interruption_after_a_take_committed_gives_back_what_it_took(
    backend, make_worker, monkeypatch, raised
):
    """Ctrl-C lands in ``process_due`` after its take committed, before any handler ran: the
    message is given back at once, unhandled and uncounted. It stayed leased under a token
    nobody held, and the end of its lease counted an attempt that no handler made: with one
    attempt allowed, it died unhandled."""
    from sqla_delayedq._consumer import BaseWorker

    fired = interrupt_once(monkeypatch, BaseWorker, "_report_buried", raised)
    retry = ExponentialBackoff(max_attempts=1, initial=timedelta(hours=1), jitter=0)
    q: DelayedQueue[Any] = DelayedQueue("interrupted-take", retry=retry)
    offer(backend, q, "m")
    handled: list[str] = []
    worker = make_worker(backend, listen=False, keep_statistics=False)
    worker.register(q, lambda env: handled.append(env.key), mode="lease")
    with pytest.raises(raised):
        worker.process_due()
    assert fired and handled == []
    with backend.Session() as s:
        info = q.get(s, "m")
    assert info is not None and info.state is State.DUE and info.lock_token is None
    assert info.attempts == 0
    assert worker.process_due() == 1 and handled == ["m"]


def test_an_interruption_in_a_hook_before_the_handlers_gives_back_what_the_take_holds(
    backend, make_worker
):
    """Ctrl-C lands in ``process_due`` in a hook that runs once the take's messages are in
    flight, before their handlers: every message the take holds is given back at once,
    unhandled and uncounted, and the next call handles each once. They stayed leased under
    tokens nobody held (only a running worker's stop gave back what was in flight), and the
    end of the lease counted an attempt that no handler made: with one attempt allowed, they
    died unhandled."""
    fired: list[str] = []

    class InterruptOnce(WorkerHooks):
        def lag(self, queue: str, seconds: float) -> None:
            if not fired:
                fired.append(queue)
                raise KeyboardInterrupt  # a hook's other errors are logged and swallowed

    retry = ExponentialBackoff(max_attempts=1, initial=timedelta(hours=1), jitter=0)
    q: DelayedQueue[Any] = DelayedQueue("interrupted-hook", retry=retry)
    with backend.Session.begin() as s:
        q.offer_batch(s, [(f"k{i}", {}) for i in range(3)])
    handled: list[str] = []
    worker = make_worker(
        backend, listen=False, keep_statistics=False, batch_size=3, hooks=InterruptOnce()
    )
    worker.register(q, lambda env: handled.append(env.key), mode="lease")
    with pytest.raises(KeyboardInterrupt):
        worker.process_due()
    assert fired and handled == []
    assert getattr(worker, "worker", worker).in_flight == 0
    with backend.Session() as s:
        infos = [q.get(s, f"k{i}") for i in range(3)]
    assert all(i is not None and i.state is State.DUE and i.lock_token is None for i in infos)
    assert [i.attempts for i in infos if i is not None] == [0, 0, 0]
    assert worker.process_due() == 3 and sorted(handled) == ["k0", "k1", "k2"]


def test_an_interrupted_failed_hook_leaves_no_failure_of_its_batch_unrecorded(backend, make_worker):
    """A batch handler fails; Ctrl-C lands in the ``failed`` hook of its first message. The
    failure of every message of the batch is recorded (the hooks run once all are): the rest
    stayed at attempt 0 with no error, and came back a lease later uncounted, so a poison batch
    escaped its attempts."""
    reported: list[str] = []

    class InterruptFailed(WorkerHooks):
        def failed(self, queue: str, envelope: Any, error: BaseException, outcome: Any) -> None:
            reported.append(envelope.key)
            raise KeyboardInterrupt

    retry = ExponentialBackoff(max_attempts=5, initial=timedelta(hours=1), jitter=0)
    q: DelayedQueue[Any] = DelayedQueue("interrupted-failed-hook", retry=retry)
    with backend.Session.begin() as s:
        q.offer_batch(s, [(f"k{i}", {}) for i in range(3)])
    handled: list[str] = []

    def handler(envs: list[Envelope[Any]]) -> None:
        handled.extend(e.key for e in envs)
        raise ValueError("batch failed")

    worker = make_worker(backend, listen=False, keep_statistics=False, hooks=InterruptFailed())
    worker.register_batch(q, handler, batch_size=3)
    with pytest.raises(KeyboardInterrupt):
        worker.process_due()
    assert sorted(handled) == ["k0", "k1", "k2"] and len(reported) == 1
    with backend.Session() as s:
        infos = [q.get(s, f"k{i}") for i in range(3)]
    assert [i.attempts for i in infos if i is not None] == [1, 1, 1]
    assert all(i is not None and i.last_error and "batch failed" in i.last_error for i in infos)


def test_a_failed_hook_the_drain_cancels_leaves_no_failure_of_its_batch_unrecorded(backend):
    """On the asyncio worker a slow ``failed`` hook is cancelled by the stop's drain timeout
    as it reports the first message of a failed batch: every failure is recorded all the same
    (the rest stayed at attempt 0, released uncounted)."""
    reporting = threading.Event()

    class Slow(WorkerHooks):
        async def failed(self, queue: str, envelope: Any, error: Any, outcome: Any) -> None:
            reporting.set()
            await asyncio.sleep(60)

    retry = ExponentialBackoff(max_attempts=5, initial=timedelta(hours=1), jitter=0)
    q: DelayedQueue[Any] = DelayedQueue("cancelled-failed-hook", retry=retry)
    with backend.Session.begin() as s:
        q.offer_batch(s, [(f"k{i}", {}) for i in range(3)])
    handled: list[str] = []

    def handler(envs: list[Envelope[Any]]) -> None:
        handled.extend(e.key for e in envs)
        raise ValueError("batch failed")

    worker = AsyncRunner(backend, listen=False, keep_statistics=False, hooks=Slow())
    worker.register_batch(q, handler, batch_size=3)
    worker.start()
    try:
        assert reporting.wait(30)
    finally:
        worker.stop(drain_timeout=0.2)
    assert sorted(handled) == ["k0", "k1", "k2"]
    with backend.Session() as s:
        infos = [q.get(s, f"k{i}") for i in range(3)]
    assert [i.attempts for i in infos if i is not None] == [1, 1, 1]
    assert all(i is not None and i.last_error and "batch failed" in i.last_error for i in infos)


def test_an_interrupted_process_due_gives_back_only_what_its_own_call_holds(backend):
    """Two threads run ``process_due`` on one worker; Ctrl-C in the first's hook gives back
    what the first took, and the message the second's handler is running stays leased to it
    (its acknowledgement is not refused, and it is handled once)."""
    running_b, go = threading.Event(), threading.Event()
    handled: list[str] = []
    fired: list[str] = []

    class InterruptMain(WorkerHooks):
        def lag(self, queue: str, seconds: float) -> None:
            if threading.current_thread() is threading.main_thread() and not fired:
                fired.append(queue)
                raise KeyboardInterrupt

    def handler(env: Envelope[Any]) -> None:
        if env.key == "b":
            running_b.set()
            assert go.wait(20)
        handled.append(env.key)

    q: DelayedQueue[Any] = DelayedQueue("two-calls")
    offer(backend, q, "b")
    worker = Worker(backend.Session, listen=False, keep_statistics=False, hooks=InterruptMain())
    worker.register(q, handler, mode="lease")
    counts: list[int] = []
    other = threading.Thread(target=lambda: counts.append(worker.process_due(limit=1)))
    other.start()
    try:
        assert running_b.wait(20)
        offer(backend, q, "a")
        with pytest.raises(KeyboardInterrupt):
            worker.process_due()
        assert fired
        with backend.Session() as s:
            a, b = q.get(s, "a"), q.get(s, "b")
        assert a is not None and a.state is State.DUE and a.lock_token is None
        assert a.attempts == 0
        assert b is not None and b.lock_token is not None  # still the other call's
    finally:
        go.set()
        other.join(20)
    assert counts == [1] and handled == ["b"]
    assert worker.process_due() == 1 and handled == ["b", "a"]
    assert pending(backend, q) == 0


def test_a_process_due_call_that_returns_leaves_the_others_running_on_one_worker(backend):
    """Two threads run ``process_due`` on one worker; the second returns while the first
    still handles a message: the first goes on handling what is offered next. Each call had
    its own runtime, the last one made was the worker's, and the call that returned stopped
    it under the other: the other's takes then released every message unhandled, counted it
    as handled, and (without a limit) took it again for ever."""
    running_m1, go = threading.Event(), threading.Event()
    handled: list[str] = []

    def handler(env: Envelope[Any]) -> None:
        if env.key == "m1":
            running_m1.set()
            assert go.wait(20)
        handled.append(env.key)

    q: DelayedQueue[Any] = DelayedQueue("side-by-side")
    offer(backend, q, "m1")
    worker = Worker(backend.Session, listen=False, keep_statistics=False)
    worker.register(q, handler, mode="lease")
    counts: list[int] = []
    first = threading.Thread(target=lambda: counts.append(worker.process_due()))
    first.start()
    try:
        assert running_m1.wait(20)
        assert worker.process_due() == 0  # m1 is the first call's
        with backend.Session.begin() as s:
            q.offer_batch(s, [("m2", {}), ("m3", {})])
    finally:
        go.set()
        first.join(20)
    assert not first.is_alive()
    assert counts == [3] and handled == ["m1", "m2", "m3"]
    assert pending(backend, q) == 0


@pytest.mark.parametrize("how", ["a timeout", "an anyio task group"])
def test_a_cancelled_asyncio_process_due_gives_back_a_running_handlers_message_a_lease_later(
    backend, how
):
    """``AsyncWorker.process_due`` is cancelled (a timeout, or an anyio task group's
    cancellation, which comes again at every await) while a handler's work goes on in a
    thread, which a cancellation cannot stop: its message is given back due a lease from now,
    uncounted, as a stop gives it back, and no other consumer runs it beside that handler.
    Given back due at once, a consumer polling took it and ran it twice at once."""
    done = threading.Event()
    runs: list[str] = []

    def slow(env: Envelope[Any]) -> None:
        runs.append(env.key)
        done.wait(20)

    lease = timedelta(minutes=5)
    q: DelayedQueue[Any] = DelayedQueue("cancelled-due", lease=lease)
    offer(backend, q, "m")
    runner = AsyncRunner(backend, listen=False, keep_statistics=False)
    runner.register(q, slow, mode="lease")  # a plain function: its work runs in a thread

    async def cut_short() -> None:
        if how == "a timeout":
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(runner.worker.process_due(), 0.5)
        else:
            import anyio

            with anyio.move_on_after(0.5):
                await runner.worker.process_due()
        await runner.engine.dispose()

    try:
        before = datetime.now(UTC)
        asyncio.run(cut_short())
        assert runs == ["m"]
        other = Worker(backend.Session, listen=False, keep_statistics=False)
        other.register(q, lambda env: runs.append(env.key), mode="lease")
        assert other.process_due() == 0 and runs == ["m"]
        with backend.Session() as s:
            info = q.get(s, "m")
        assert info is not None and info.lock_token is None and info.attempts == 0
        assert info.scheduled_at is not None and info.scheduled_at >= before + lease
    finally:
        done.set()


@pytest.mark.parametrize("how", ["cancelled three times", "an anyio task group"])
def test_an_asyncio_run_cancelled_again_and_again_releases_what_its_handlers_hold(
    server_backend, how
):
    """``run()`` cancelled more than once: by ``task.cancel()`` again while it stops, or by an
    anyio task group (Starlette's and FastAPI's lifespans), whose cancellation comes again at
    every await until the task ends. The third cut the stop short before it released what the
    cut-off handlers held: the rows stayed leased under tokens nobody held, and the lease's
    end counted an attempt (dead, with one allowed, though no handler had finished)."""
    import anyio

    retry = ExponentialBackoff(max_attempts=1, initial=timedelta(hours=1), jitter=0)
    lease = timedelta(minutes=5)
    q: DelayedQueue[Any] = DelayedQueue("cancelled-again", lease=lease, retry=retry)
    keys = [f"m{i}" for i in range(4)]
    with server_backend.Session() as s, s.begin():
        q.offer_batch(s, [(k, {}) for k in keys])
    started: list[str] = []
    runner = AsyncRunner(server_backend, concurrency=4, listen=False, keep_statistics=False)

    async def handle(env: Envelope[Any]) -> None:
        started.append(env.key)
        await asyncio.sleep(60)

    runner.worker.register(q, handle, mode="lease")

    async def all_started() -> None:
        while len(started) < len(keys):
            await asyncio.sleep(0.02)

    async def main() -> None:
        run = functools.partial(runner.worker.run, install_signal_handlers=False)
        try:
            if how == "an anyio task group":
                async with anyio.create_task_group() as tg:
                    tg.start_soon(run)
                    await asyncio.wait_for(all_started(), 20)
                    tg.cancel_scope.cancel()
            else:
                task = asyncio.create_task(run())
                await asyncio.wait_for(all_started(), 20)
                for _ in range(3):
                    task.cancel()
                    await asyncio.sleep(0)
                with pytest.raises(asyncio.CancelledError):
                    await task
        finally:
            await runner.engine.dispose()

    before = datetime.now(UTC)
    asyncio.run(main())
    assert runner.worker.in_flight == 0
    with server_backend.Session() as s:
        for key in keys:  # released a lease from now (a handler may still run), uncounted
            info = q.get(s, key)
            assert info is not None and info.status == "pending", key
            assert (info.lock_token, info.attempts) == (None, 0), key
            assert info.scheduled_at is not None and info.scheduled_at >= before + lease


def stop_while_its_settle_waits(
    backend: Any, q: DelayedQueue[Any], fails: bool, how: str = "a stop"
) -> list[str]:
    """The asyncio stop (drain timeout 0) cancels a consumer while the settle of its handler
    (an acknowledgement, or with ``fails`` the record of the failure) awaits its reply: another
    transaction holds the message's row. ``how="an anyio task group"``: ``process_due`` in a
    task group whose cancellation comes again at every await, the settle made again included.
    The keys the handler ran on."""
    offer(backend, q, "m")
    table = cast(sa.Table, DelayedMessage.__table__)
    locked, settling = threading.Event(), threading.Event()
    runs: list[str] = []

    def hold_the_row() -> None:
        with backend.engine.connect() as conn:
            conn.execute(sa.select(table.c.id).where(table.c.key == "m").with_for_update())
            locked.set()
            time.sleep(1.5)
            conn.rollback()

    async def handle(env: Envelope[Any]) -> None:
        runs.append(env.key)
        threading.Thread(target=hold_the_row, daemon=True).start()
        await asyncio.to_thread(locked.wait, 10)
        settling.set()
        if fails:
            raise RuntimeError("poison")

    runner = AsyncRunner(
        backend, concurrency=1, drain_timeout=0, listen=False, keep_statistics=False
    )
    runner.worker.register(q, handle, mode="lease")

    async def main() -> None:
        try:
            if how == "an anyio task group":
                import anyio

                async with anyio.create_task_group() as tg:
                    tg.start_soon(runner.worker.process_due)
                    assert await asyncio.to_thread(settling.wait, 20)
                    await asyncio.sleep(0.3)  # its settle waits for the row
                    tg.cancel_scope.cancel()
            else:
                task = asyncio.create_task(runner.worker.run(install_signal_handlers=False))
                assert await asyncio.to_thread(settling.wait, 20)
                await asyncio.sleep(0.3)
                runner.worker.request_stop()
                await task
        finally:
            await runner.engine.dispose()

    asyncio.run(main())
    return runs


@pytest.mark.parametrize("how", ["a stop", "an anyio task group"])
def test_a_stop_that_cancels_an_asyncio_acknowledgement_makes_it_again(server_backend, how):
    """The asyncio stop (a drain timeout of 0) cancelled a consumer while its succeeded
    handler's acknowledgement awaited its reply (here: another transaction holds the row). The
    acknowledgement was dropped and the stop released the message, which ran again a lease
    later without a word (1 in 40 stops on PostgreSQL, 11 in 40 on MariaDB, in review)."""
    q: DelayedQueue[Any] = DelayedQueue("ack-cancelled", lease=timedelta(seconds=2))
    assert stop_while_its_settle_waits(server_backend, q, fails=False, how=how) == ["m"]
    assert pending(server_backend, q) == 0  # acknowledged, not released to run again


@pytest.mark.parametrize("mode", MODES)
def test_a_handler_s_own_cancellation_during_a_drain_is_a_failed_attempt(backend, mode):
    """A handler raised a ``CancelledError`` of its own (it awaited a future someone else
    cancelled) while the worker drained after a stop request: it was taken for the drain's own
    cancellation, so the attempt went uncounted and unreported and ``run()`` returned True.
    Like the same error outside a stop, it is now a failed attempt and stops the worker loudly."""
    from sqla_delayedq import WorkerError

    retry = ExponentialBackoff(max_attempts=1, initial=timedelta(hours=1), jitter=0)
    q: DelayedQueue[Any] = DelayedQueue("own-cancel", lease=timedelta(minutes=5), retry=retry)
    offer(backend, q, "m")
    runner = AsyncRunner(backend, concurrency=1, drain_timeout=10, listen=False)

    async def main() -> None:
        shared = asyncio.get_running_loop().create_future()
        entered = asyncio.Event()

        async def handle(env: Envelope[Any], session: Any = None) -> None:
            entered.set()
            await shared  # cancelled by someone else below: the handler's own error

        runner.worker.register(q, handle, mode=mode)
        task = asyncio.create_task(runner.worker.run(install_signal_handlers=False))
        try:
            await asyncio.wait_for(entered.wait(), 20)
            runner.worker.request_stop()
            await asyncio.sleep(0.1)  # draining: it would wait up to 10 s
            shared.cancel()
            with pytest.raises(WorkerError):
                await asyncio.wait_for(task, 20)
        finally:
            await runner.engine.dispose()

    asyncio.run(main())
    with backend.Session() as s:
        info = q.get(s, "m")
    assert info is not None and (info.status, info.attempts) == ("dead", 1)
    assert "CancelledError" in (info.last_error or "")


@pytest.mark.parametrize("how", ["a stop", "an anyio task group"])
def test_a_stop_that_cancels_an_asyncio_failure_record_records_it_again(server_backend, how):
    """As for an acknowledgement: the stop cancelled the record of a failed attempt as it
    awaited its reply. The stop then released the message, uncounted, so a poison message
    stopped that way ran for ever; the failure is now recorded again."""
    retry = ExponentialBackoff(max_attempts=3, initial=timedelta(hours=1), jitter=0)
    q: DelayedQueue[Any] = DelayedQueue("nack-cancelled", lease=timedelta(seconds=2), retry=retry)
    before = datetime.now(UTC)
    assert stop_while_its_settle_waits(server_backend, q, fails=True, how=how) == ["m"]
    with server_backend.Session() as s:
        info = q.get(s, "m")
    assert info is not None and info.attempts == 1 and info.last_error is not None
    assert info.scheduled_at is not None and info.scheduled_at > before + timedelta(minutes=50)


def limited_queue(backend: Any, name: str, lease: timedelta) -> DelayedQueue[Any]:
    """A queue with one attempt allowed, a limit (its transactional take is a lease committed
    apart, on a server) and one message ``m``."""
    retry = ExponentialBackoff(max_attempts=1, initial=timedelta(hours=1), jitter=0)
    q: DelayedQueue[Any] = DelayedQueue(name, retry=retry, lease=lease)
    with backend.Session.begin() as s:
        q.set_limits(s, max_in_flight=5)
    offer(backend, q, "m")
    return q


def given_back_uncounted(backend: Any, q: DelayedQueue[Any]) -> MessageInfo:
    with backend.Session() as s:
        info = q.get(s, "m")
    assert info is not None and info.lock_token is None and info.attempts == 0
    return info


def test_on_a_limited_queue_an_interruption_before_a_transactional_handler_gives_back_its_lease(
    server_backend, make_worker
):
    """Ctrl-C lands in a hook after a limited queue's transactional take committed its lease
    apart, before the handler: the lease is given back at once, uncounted. The rollback of the
    handler's transaction left it, and the end of the lease counted an attempt that no handler
    made: with one attempt allowed, the message died unhandled."""
    fired: list[str] = []

    class InterruptOnce(WorkerHooks):
        def lag(self, queue: str, seconds: float) -> None:
            if not fired:
                fired.append(queue)
                raise KeyboardInterrupt

    q = limited_queue(server_backend, "limited-interrupted", timedelta(minutes=5))
    handled: list[str] = []
    worker = make_worker(server_backend, listen=False, keep_statistics=False, hooks=InterruptOnce())
    worker.register(q, lambda env, s: handled.append(env.key), mode="transactional")
    with pytest.raises(KeyboardInterrupt):
        worker.process_due()
    assert fired and handled == []
    assert given_back_uncounted(server_backend, q).state is State.DUE
    worker = make_worker(server_backend, listen=False, keep_statistics=False)
    worker.register(q, lambda env, s: handled.append(env.key), mode="transactional")
    assert worker.process_due() == 1 and handled == ["m"]


def test_on_a_limited_queue_a_transaction_lost_before_its_handler_gives_back_its_lease(
    server_backend, monkeypatch
):
    """The connection of a limited queue's transactional take is lost after its lease was
    committed apart, before the handler ran (at the handler's savepoint): the lease is given
    back at once, uncounted, and the next take handles the message. It stayed leased under a
    token nobody held, and its end counted an attempt no handler made (dead, unhandled)."""
    from sqla_delayedq import _handlers, _leases

    real = _handlers.run_in_savepoint
    fired: list[str] = []

    def lost_at_savepoint(session: Session, handler: Any, envelope: Any) -> Any:
        if not fired:
            fired.append(envelope.key)
            raise sa.exc.OperationalError(
                "SAVEPOINT sa_savepoint_1",
                {},
                Exception("server closed the connection unexpectedly"),
                connection_invalidated=True,
            )
        return real(session, handler, envelope)

    monkeypatch.setattr(_leases, "run_in_savepoint", lost_at_savepoint)
    q = limited_queue(server_backend, "limited-lost", timedelta(minutes=5))
    handled: list[str] = []
    worker = Worker(server_backend.Session, listen=False, keep_statistics=False)
    worker.register(q, lambda env, s: handled.append(env.key), mode="transactional")
    assert worker.process_due() == 1  # the lost transaction is retried, as a take's is
    assert fired == ["m"] and handled == ["m"]
    assert pending(server_backend, q) == 0


def test_on_a_limited_queue_a_stop_that_cancels_a_transactional_handler_gives_back_its_lease(
    server_backend,
):
    """The asyncio worker's stop cancels a limited queue's transactional handler when its
    drain times out: the lease committed apart is given back uncounted, a lease from now (as
    in lease mode), and the next take handles the message. The handler's end took it out of
    what is in flight before the stop released that: it stayed leased under a token nobody
    held, and the end of the lease counted an attempt (dead, with one allowed)."""
    started: list[str] = []

    async def sleepy(env: Envelope[Any], session: Any) -> None:
        started.append(env.key)
        await asyncio.sleep(30)

    lease = timedelta(minutes=5)
    q = limited_queue(server_backend, "limited-stopped", lease)
    runner = AsyncRunner(
        server_backend, concurrency=1, poll_interval=0.1, listen=False, keep_statistics=False
    )
    runner.worker.register(q, sleepy, mode="transactional")
    before = datetime.now(UTC)
    runner.start()
    try:
        assert wait_for(lambda: started == ["m"], 15)
    finally:
        assert runner.stop(0.3) is False  # its handler was cancelled
    info = given_back_uncounted(server_backend, q)
    assert info.scheduled_at is not None and info.scheduled_at >= before + lease


@pytest.mark.parametrize("statement", ["take", "ack and take"])
def test_on_postgresql_an_interruption_while_a_statement_alone_awaits_its_reply_loses_nothing(
    pg, monkeypatch, statement
):
    """The asyncio worker's stop cancels a consumer whose take alone, or whose acknowledgement
    that takes the next message, committed on the server but whose reply is still on its way
    (a drain timeout of 0 does so wherever a consumer is). What it took is given back, what it
    acknowledged stays so, and every message is handled once, none dead. The taken message
    stayed leased under a token nobody held, and with one attempt allowed died unhandled."""
    from sqlalchemy.util import await_only

    from sqla_delayedq import controls

    monkeypatch.setattr(controls, "REFRESH", 600.0)  # the picture of the controls stays fresh
    monkeypatch.setattr(controls, "MIN_REFRESH", 600.0)  # a worker's keep_fresh too
    name = "claim" if statement == "take" else "ack_and_claim"
    real = getattr(PostgreSQLStrategy, name)
    fired = threading.Event()

    def slow_reply(self: Any, session: Session, *args: Any, **kw: Any) -> Any:
        got = real(self, session, *args, **kw)
        claims = got if name == "claim" else got and got[1]
        if not fired.is_set() and claims is not None and claims.claimed:
            fired.set()
            await_only(asyncio.sleep(10))  # the reply is on its way: the stop cancels here
        return got

    monkeypatch.setattr(PostgreSQLStrategy, name, slow_reply)
    retry = ExponentialBackoff(max_attempts=1, initial=timedelta(hours=1), jitter=0)
    q: DelayedQueue[Any] = DelayedQueue(f"cancelled-{name}", retry=retry)
    handled: list[str] = []
    runner = AsyncRunner(pg, concurrency=1, poll_interval=5.0, listen=False, keep_statistics=False)
    runner.register(q, lambda env: handled.append(env.key), mode="lease")
    runner.start()
    assert wait_for(lambda: waiting(runner) == 1, 15)
    with pg.Session() as s, s.begin():
        q.gate(s)  # this process's picture of the controls: fresh, so takes run alone
        q.offer_batch(s, [(k, {}) for k in ("a", "b", "c")])
    assert fired.wait(15)
    runner.stop(0)
    worker = Worker(pg.Session, listen=False, keep_statistics=False)
    worker.register(q, lambda env: handled.append(env.key), mode="lease")
    worker.process_due()
    assert sorted(handled) == ["a", "b", "c"]
    with pg.Session() as s:
        assert q.counts(s).dead == 0 and q.counts(s).pending == 0


def test_a_batch_handler_that_empties_its_list_still_has_every_message_acknowledged(
    backend, make_worker
):
    """The batch handler was given the very list the worker then acknowledged: a handler that
    consumed it (``while envs: envs.pop()``) left its messages neither acknowledged nor failed,
    their leases extended until the worker stopped, and then handled again."""
    q: DelayedQueue[Any] = DelayedQueue("batch-pop", lease=timedelta(seconds=30))
    with backend.Session() as s, s.begin():
        q.offer_batch(s, [(f"m{i}", {"i": i}) for i in range(5)])
    handled: list[str] = []

    def handler(envs: list[Envelope[Any]]) -> None:
        while envs:
            handled.append(envs.pop().key)

    worker = make_worker(backend, concurrency=1, poll_interval=0.05, listen=False)
    worker.register_batch(q, handler, batch_size=10)
    with running(worker):
        assert wait_for(lambda: pending(backend, q) == 0, 30)
    assert sorted(handled) == [f"m{i}" for i in range(5)]


def test_a_transient_error_of_a_transactional_handler_counts_as_an_attempt(backend, make_worker):
    """A transient database error raised by the handler itself (its other database is down)
    was re-raised as the consumer's own: the take rolled back, no attempt was counted, and the
    same message ran again and again, for ever. Lease mode counted it; now both modes do."""
    retry = ExponentialBackoff(max_attempts=3, initial=timedelta(0), jitter=0)
    q: DelayedQueue[Any] = DelayedQueue("transient-handler", retry=retry)
    offer(backend, q, "k")
    runs: list[int] = []

    def handler(env: Envelope[Any], session: Session) -> None:
        runs.append(env.attempt)
        raise TransientError("the handler's other database is down")

    hooks = RecordingHooks()
    worker = make_worker(backend, concurrency=1, poll_interval=0.02, listen=False, hooks=hooks)
    worker.register(q, handler, mode="transactional")
    with running(worker):
        assert wait_for(lambda: len(hooks.failed_) == 3, 30)
        time.sleep(0.3)
    assert runs == [1, 2, 3]
    assert [f[4] for f in hooks.failed_] == [NackOutcome.RETRY_SCHEDULED] * 2 + [DEAD]
    with backend.Session() as s:
        info = q.get(s, "k")
    assert info is not None and info.state is State.DEAD and info.attempts == 3
    assert "other database is down" in (info.last_error or "")


# -- transactional mode: the transaction is the consumer's -----------------------------------


def test_a_transactional_handler_s_commit_is_refused_and_its_message_kept(backend, make_worker):
    """Regression: a handler's session.commit() committed the message's removal; when the
    handler then raised, the message was gone, its failure unrecorded, and the worker stopped.
    The commit is now refused inside the handler: a failed attempt like any other."""
    retry = ExponentialBackoff(max_attempts=2, initial=timedelta(milliseconds=10), jitter=0)
    q: DelayedQueue[Any] = DelayedQueue("commits", retry=retry)
    side: DelayedQueue[Any] = DelayedQueue("commits-side")
    offer(backend, q, "m")
    offer(backend, q, "forgiven")
    runs: list[tuple[str, int]] = []

    def handler(env: Envelope[Any], session: Session) -> None:
        runs.append((env.key, env.attempt))
        side.offer(session, env.key, {"written": "by the handler"})
        if env.key == "m":
            session.commit()  # refused: raises HandlerMisuse, so this attempt fails
        with contextlib.suppress(HandlerMisuse):
            session.commit()  # refused, and the handler goes on: it succeeds

    hooks = RecordingHooks()
    worker = make_worker(backend, concurrency=1, poll_interval=0.02, listen=False, hooks=hooks)
    worker.register(q, handler, mode="transactional")
    with running(worker):
        assert wait_for(lambda: len(runs) >= 3 and pending(backend, q) == 0, 30, 0.05)
    assert sorted(runs) == [("forgiven", 1), ("m", 1), ("m", 2)]
    with backend.Session() as s:
        info = q.get(s, "m")
        assert info is not None and info.state is State.DEAD and info.attempts == 2
        assert "must not commit" in (info.last_error or "")
        assert q.get(s, "forgiven") is None  # handled: removed with the handler's write
        assert side.get(s, "forgiven") is not None and side.get(s, "m") is None
    assert [(f[1], type(f[3])) for f in hooks.failed_] == [("m", HandlerMisuse)] * 2
    assert [p[1] for p in hooks.processed_] == ["forgiven"]


def test_a_transactional_handler_that_rolls_back_stops_the_worker_and_keeps_its_message(
    backend, make_worker
):
    """A rollback cannot be refused: it undid the take, and the handler returning looked like
    success, so the same message ran again and again, never counted. The worker now stops
    with HandlerMisuse, and the message waits, due, for a corrected handler."""
    q: DelayedQueue[Any] = DelayedQueue("rollbacks")
    offer(backend, q, "m")
    runs: list[int] = []

    def handler(env: Envelope[Any], session: Session) -> None:
        runs.append(env.attempt)
        session.rollback()

    worker = make_worker(backend, concurrency=1, poll_interval=0.02, listen=False)
    worker.register(q, handler, mode="transactional")
    worker.start()
    try:
        assert wait_for(lambda: bool(runs), 30)
        time.sleep(0.5)
    finally:
        try:
            worker.stop(5)  # a thread Worker keeps the error (run() raises it)
            error = worker.failure
        except WorkerError as exc:  # the asyncio worker's run() raised it
            error = exc.__cause__
    assert isinstance(error, HandlerMisuse) and "rolled back" in str(error)
    assert runs == [1]
    with backend.Session() as s:
        info = q.get(s, "m")
        assert info is not None and info.state is State.DUE and info.attempts == 0


# -- transactional mode: the handler's writes -------------------------------------------------

effects = sa.Table(
    "wk_effects",
    sa.MetaData(),
    sa.Column("key", sa.String(200), primary_key=True),
    sa.Column("note", sa.String(100), nullable=False),
)


@pytest.fixture
def effects_table(backend):
    effects.drop(backend.engine, checkfirst=True)
    effects.create(backend.engine)
    yield effects
    effects.drop(backend.engine, checkfirst=True)


def test_transactional_writes_commit_with_the_ack_and_roll_back_on_failure(
    backend, effects_table, make_worker
):
    retry = ExponentialBackoff(max_attempts=5, initial=timedelta(hours=1), jitter=0)
    q: DelayedQueue[Any] = DelayedQueue("effects", retry=retry)
    with backend.Session() as s, s.begin():
        q.offer(s, "good", {"fail": None})
        q.offer(s, "raises", {"fail": "raise"})
        q.offer(s, "sql-error", {"fail": "sql"})

    def handler(env: Envelope[Any], session: Session) -> None:
        session.execute(effects.insert().values(key=env.key, note="written"))
        if env.payload["fail"] == "raise":
            raise RuntimeError("failed after writing")
        if env.payload["fail"] == "sql":  # a database error inside the handler's own work
            session.execute(effects.insert().values(key=env.key, note="again"))

    hooks = RecordingHooks()
    worker = make_worker(backend, concurrency=1, poll_interval=0.1, listen=False, hooks=hooks)
    worker.register(q, handler, mode="transactional")
    with running(worker):
        assert wait_for(lambda: len(hooks.processed_) + len(hooks.failed_) >= 3, 10)
    assert [p[1] for p in hooks.processed_] == ["good"]
    assert sorted(f[1] for f in hooks.failed_) == ["raises", "sql-error"]
    with backend.Session() as s:
        written = s.execute(sa.select(effects.c.key, effects.c.note)).all()
        assert [tuple(r) for r in written] == [("good", "written")]
        assert q.get(s, "good") is None  # acknowledged in the same commit as the write
        failed = {k: q.get(s, k) for k in ("raises", "sql-error")}
    raised, sql_error = failed["raises"], failed["sql-error"]
    assert raised is not None and sql_error is not None
    assert raised.attempts == 1 and sql_error.attempts == 1
    assert "RuntimeError: failed after writing" in (raised.last_error or "")
    assert "IntegrityError" in (sql_error.last_error or "")
    assert raised.status == sql_error.status == "pending"


KILL_OWN_CONNECTION = {
    "postgresql": ("SELECT pg_backend_pid()", "SELECT pg_terminate_backend(:id)"),
    "mariadb": ("SELECT CONNECTION_ID()", "KILL CONNECTION :id"),
}


@pytest.mark.parametrize("grouped", [False, True], ids=["plain", "grouped"])
def test_a_lost_connection_in_a_transactional_handler_is_retried_not_a_failed_attempt(
    server_backend, make_worker, grouped
):
    """DESIGN §7: a lost connection is a transient database error, retried; nothing is lost.

    The transaction that took the message is gone with the connection, so the message is due
    again at once; it must not count as a failed attempt (with ``max_attempts=1`` that would
    make it dead). Grouped, the take held the group (a named lock on MariaDB): the group is
    free again with the lost session, and the rollback of a dead connection does not fail.
    """
    q: DelayedQueue[Any] = DelayedQueue(
        "lost-connection", retry=ExponentialBackoff(max_attempts=1), groups=grouped
    )
    offer(server_backend, q, "m", group="g" if grouped else None)
    own_id, kill = KILL_OWN_CONNECTION[server_backend.name]
    calls: list[int] = []

    def handler(env: Envelope[Any], session: Session) -> None:
        calls.append(env.attempt)
        if len(calls) == 1:
            conn_id = session.execute(sa.text(own_id)).scalar_one()
            with server_backend.engine.connect() as other:
                other.execute(sa.text(kill), {"id": conn_id})
            session.execute(sa.text("SELECT 1"))  # the connection is gone: this raises

    hooks = RecordingHooks()
    worker = make_worker(
        server_backend, concurrency=1, poll_interval=0.1, listen=False, hooks=hooks
    )
    worker.register(q, handler, mode="transactional")
    with running(worker):
        assert wait_for(
            lambda: bool(hooks.processed_) or any(f[4] is DEAD for f in hooks.failed_), 30
        )
    with server_backend.Session() as s:
        info = q.get(s, "m")
    assert info is None or info.status != "dead", f"a lost connection buried it: {info}"
    assert [p[1] for p in hooks.processed_] == ["m"]
    assert calls == [1, 1]


# -- wake-ups ---------------------------------------------------------------------------------


def test_an_idle_worker_wakes_on_an_offer_committed_in_this_process(backend, make_worker):
    q: DelayedQueue[Any] = DelayedQueue("wake")
    handled: list[float] = []
    worker = make_worker(backend, concurrency=2, poll_interval=30, listen=False)
    worker.register(q, lambda env: handled.append(time.monotonic()))
    with running(worker):
        # Every thread has polled once and sleeps for up to 30 s.
        assert wait_for(lambda: waiting(worker) == 2, 30)
        offered = time.monotonic()
        offer(backend, q, "now")
        assert wait_for(lambda: bool(handled), 15)
    assert handled[0] - offered < 10.0  # woken (bench L1 times it), not the 30 s poll


def test_an_idle_worker_sleeps_only_until_the_next_due_message(backend, make_worker):
    q: DelayedQueue[Any] = DelayedQueue("next-due")
    handled: list[datetime] = []
    worker = make_worker(backend, concurrency=2, poll_interval=30, listen=False)
    worker.register(q, lambda env: handled.append(utcnow()))
    with running(worker):
        assert wait_for(lambda: waiting(worker) == 2, 30)
        offered = utcnow()
        due = offered + timedelta(seconds=0.5)
        offer(backend, q, "soon", at=due)
        assert wait_for(lambda: bool(handled), 15)
    assert due <= handled[0] <= offered + timedelta(seconds=10)  # not the 30 s poll


def test_a_lease_consumer_that_took_sleeps_until_the_next_due_message(backend, make_worker):
    """A take that got a message and saw nothing more due: the consumer sleeps until the next
    scheduled message (read in the take's own statement on PostgreSQL), not the 30 s poll, and
    not until its own message's lease would end."""
    q: DelayedQueue[Any] = DelayedQueue("next-due-after-take", lease=timedelta(minutes=5))
    handled: list[tuple[str, datetime]] = []
    worker = make_worker(backend, concurrency=1, poll_interval=30, listen=False)
    worker.register(q, lambda env: handled.append((env.key, utcnow())))
    offered = utcnow()
    due = offered + timedelta(seconds=1.5)
    with backend.Session() as s, s.begin():
        q.offer(s, "now", {})
        q.offer(s, "soon", {}, due)
    with running(worker):
        assert wait_for(lambda: len(handled) == 2, 20)
    assert [k for k, _ in handled] == ["now", "soon"]
    assert due <= handled[1][1] <= offered + timedelta(seconds=10)  # not the 30 s poll


def test_a_due_row_a_take_looked_ahead_to_goes_to_an_idle_consumer_at_once(backend, make_worker):
    """A lease take locks the row after those it takes until it commits, to know whether more
    is due; a consumer woken meanwhile skips that row. The take that saw more wakes an idle
    consumer, which takes the row at once, not the first consumer after its handler."""
    q: DelayedQueue[Any] = DelayedQueue("look-ahead-handoff")
    silent: DelayedQueue[Any] = DelayedQueue("look-ahead-handoff", notify=False)
    b_started = threading.Event()
    seen: dict[str, bool] = {}

    def handle(env: Any) -> None:
        if env.key == "a":
            seen["b while a ran"] = b_started.wait(10)
        elif env.key == "b":
            b_started.set()

    worker = make_worker(backend, concurrency=2, poll_interval=30, listen=False)
    worker.register(q, handle)
    now = utcnow()
    with running(worker):
        assert wait_for(lambda: waiting(worker) == 2, 20)
        with backend.Session() as s, s.begin():
            silent.offer(s, "a", {}, now - timedelta(seconds=2))  # no wake-up for these two
            silent.offer(s, "b", {}, now - timedelta(seconds=1))
            q.offer(s, "later", {}, now + timedelta(minutes=5))  # wakes one consumer
        assert wait_for(lambda: "b while a ran" in seen, 30)
    assert seen["b while a ran"]  # before: b waited for a's handler (and its 10 s)


def test_an_idle_lease_consumer_asks_for_no_next_due_time_after_a_take(pg):
    """On PostgreSQL a take that found no more due reads when the next row is due in its own
    statement: no separate query for it."""
    q: DelayedQueue[Any] = DelayedQueue("ahead-lease")
    handled: list[str] = []
    statements: list[str] = []
    worker = Worker(pg.Session, concurrency=1, poll_interval=30, listen=False)
    worker.register(q, lambda env: handled.append(env.key))

    def before(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    with running(worker):
        assert wait_for(lambda: waiting(worker) == 1, 20)
        with pg.Session() as s, s.begin():
            q.offer(s, "now", {})
            q.offer(s, "later", {}, utcnow() + timedelta(minutes=5))
        sa.event.listen(pg.engine, "before_cursor_execute", before)
        try:
            assert wait_for(lambda: handled == ["now"] and waiting(worker) == 1, 20)
        finally:
            sa.event.remove(pg.engine, "before_cursor_execute", before)
    takes = [s for s in statements if s.lstrip().startswith("WITH picked")]
    assert len(takes) == 1 and "AS next_at" in takes[0]
    asked = [s for s in statements if s.lstrip().startswith("SELECT min(")]
    assert asked == [], asked


def test_an_empty_lease_take_reads_when_the_next_message_is_due_in_its_own_statement(pg):
    """On PostgreSQL a lease take that found nothing (a consumer woken for a message another
    consumer took first, or starting on a queue with only later messages) still reads when the
    next row is due: the consumer sleeps until then, with no separate query to ask."""
    q: DelayedQueue[Any] = DelayedQueue("ahead-empty-take")
    handled: list[tuple[str, datetime]] = []
    statements: list[str] = []
    worker = Worker(pg.Session, concurrency=1, poll_interval=30, listen=False)
    worker.register(q, lambda env: handled.append((env.key, utcnow())))
    offered = utcnow()
    due = offered + timedelta(seconds=1.5)
    with pg.Session() as s, s.begin():
        q.offer(s, "later", {}, due)

    def before(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    sa.event.listen(pg.engine, "before_cursor_execute", before)
    try:
        with running(worker):
            assert wait_for(lambda: len(handled) == 1, 20)
    finally:
        sa.event.remove(pg.engine, "before_cursor_execute", before)
    assert due <= handled[0][1] <= offered + timedelta(seconds=10)  # not the 30 s poll
    takes = [s for s in statements if s.lstrip().startswith("WITH picked")]
    assert len(takes) >= 2 and all("AS next_at" in take for take in takes)
    asked = [s for s in statements if s.lstrip().startswith("SELECT min(")]
    assert asked == [], asked


class Takes:
    """Takes of a queue, and those that found nothing."""

    def __init__(self) -> None:
        self.takes = 0
        self.empty = 0
        self.lock = threading.Lock()

    def settled(self, quiet: float = 0.5) -> tuple[int, int]:
        """(takes, empty takes) once no take happened for ``quiet`` seconds."""
        last = (-1, -1)
        while (self.takes, self.empty) != last:
            last = (self.takes, self.empty)
            time.sleep(quiet)
        return last


class TakeCounter(Takes):
    """Counts the takes a worker makes of a queue (``poll_batch``, or ``poll_alone`` where a
    take commits on its own)."""

    def __init__(self, q: DelayedQueue[Any]) -> None:
        super().__init__()
        take, alone = q.poll_batch, q.poll_alone

        def count(polled: Any) -> Any:
            if polled is not None:  # None: poll_alone did not take here
                with self.lock:
                    self.takes += 1
                    self.empty += not polled.envelopes
            return polled

        q.poll_batch = lambda session, n, **kw: count(take(session, n, **kw))  # type: ignore[method-assign]
        q.poll_alone = lambda session, n, lease: count(alone(session, n, lease))  # type: ignore[method-assign]


@pytest.mark.parametrize(
    ("messages", "batch_size", "takes", "empty"),
    [(1, 1, 1, 0), (1, 2, 1, 0), (3, 5, 1, 0), (4, 2, 4, 2)],
)
def test_an_offer_wakes_as_many_idle_consumers_as_its_messages_need(
    backend, make_worker, messages, batch_size, takes, empty
):
    """Not every idle consumer: the others would only find nothing (issue 19).

    A take that found no more than it asked for ends its consumer's pass, so one message is one
    take. With 4 messages in batches of 2, two consumers wake; whichever pick saw a third row
    takes again, and wakes a third consumer for that row (it was locked, so the other woken
    consumer may have skipped it); either take may find the last two gone (at most two empty
    takes, of four). When the two picks ran at once, neither saw a third row (each skipped the
    other's), and two takes carry all four.
    """
    q: DelayedQueue[Any] = DelayedQueue("wake-n")
    handled: list[str] = []
    counter = TakeCounter(q)
    worker = make_worker(
        backend, concurrency=4, poll_interval=30, listen=False, batch_size=batch_size
    )
    worker.register(q, lambda env: handled.append(env.key))
    with running(worker):
        # Every consumer took nothing once and sleeps for 30 s.
        assert wait_for(lambda: waiting(worker) == 4, 30)
        before = counter.settled()
        assert before == (4, 4)
        with backend.Session() as s, s.begin():
            q.offer_batch(s, [(f"k{i}", {}) for i in range(messages)])
        assert wait_for(lambda: len(handled) == messages, 15)
        assert wait_for(lambda: waiting(worker) == 4, 15)
        after = counter.settled()
    assert sorted(handled) == [f"k{i}" for i in range(messages)]
    # Two consumers picking at once skip each other's locked rows, so neither may see a row past
    # its batch: then no one takes again, and the fewest takes that can carry them all is right.
    assert -(-messages // batch_size) <= after[0] - before[0] <= takes
    assert after[1] - before[1] <= empty


def test_an_offer_an_idle_consumer_takes_does_not_send_a_busy_one_looking_too(backend, make_worker):
    """Issue 19: while one consumer runs a long handler, five offers each wake the idle one,
    which takes them. The busy consumer, when its handler ends, does not take again for
    wake-ups another consumer served (it used to: one empty take)."""
    q: DelayedQueue[Any] = DelayedQueue("busy")
    handled: list[str] = []
    release = threading.Event()

    def handler(env: Envelope[Any]) -> None:
        if env.key == "slow":
            assert release.wait(30)
        handled.append(env.key)

    counter = TakeCounter(q)
    worker = make_worker(backend, concurrency=2, poll_interval=30, listen=False)
    worker.register(q, handler)
    with running(worker):
        assert wait_for(lambda: waiting(worker) == 2, 30)
        before = counter.settled()
        offer(backend, q, "slow")
        assert wait_for(lambda: counter.takes == before[0] + 1, 15)
        assert wait_for(lambda: waiting(worker) == 1, 15)
        keys: list[str] = []
        for i in range(5):
            keys.append(f"k{i}")
            offer(backend, q, keys[-1])
            assert wait_for(lambda: len(handled) == len(keys), 15)
            # The idle consumer waits again before the next offer.
            assert wait_for(lambda: waiting(worker) == 1, 15)
        release.set()
        assert wait_for(lambda: len(handled) == 6, 15)
        assert wait_for(lambda: waiting(worker) == 2, 15)
        after = counter.settled()
    assert sorted(handled) == sorted([*keys, "slow"])
    assert (after[0] - before[0], after[1] - before[1]) == (6, 0)


class ProcessCounter(Takes):
    """Counts a transactional worker's takes of a queue (``process_next``)."""

    def __init__(self, q: DelayedQueue[Any]) -> None:
        super().__init__()
        process = q.process_next

        def counted(session: Session, handler: Any) -> Any:
            result, ahead = process(session, handler)
            with self.lock:
                self.takes += 1
                self.empty += result is None
            return result, ahead

        q.process_next = counted  # type: ignore[method-assign]


#: A producer process: one offer to ``sys.argv[2]`` per line read, key = the line; prints "ok".
PRODUCER = """
import sys
from sqlalchemy.orm import sessionmaker
from sqla_delayedq import DelayedQueue, create_engine
sessions, q = sessionmaker(create_engine(sys.argv[1])), DelayedQueue(sys.argv[2])
for line in sys.stdin:
    with sessions() as s, s.begin():
        q.offer(s, line.strip(), {})
    print("ok", flush=True)
"""


@contextlib.contextmanager
def producer_process(backend: Any, queue: str) -> Iterator[Callable[[str], None]]:
    """``offer(key)`` in another process (a web app's offers, as a worker sees them)."""
    url = backend.url.render_as_string(hide_password=False)
    proc = subprocess.Popen(
        [sys.executable, "-c", PRODUCER, url, queue],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None

    def offer_there(key: str) -> None:
        proc.stdin.write(key + "\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "ok"

    try:
        yield offer_there
    finally:
        proc.stdin.close()
        assert proc.wait(30) == 0


def listening(backend: Any) -> bool:
    """Whether a connection to the backend's database LISTENs (a worker's listener)."""
    stmt = sa.text(
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE datname = current_database() AND query LIKE 'LISTEN%'"
    )
    with backend.engine.connect() as conn:
        return bool(conn.execute(stmt).scalar())


def test_a_transactional_consumer_does_not_take_again_when_its_take_saw_nothing_more(
    pg, make_worker
):
    """Issue 19: one message at a time from a producer process, each handled before the next
    is offered. The take reads the queue's next due time in its own statement (PostgreSQL), so
    a consumer whose take saw nothing more waits for the next offer's wake-up: one take per
    message, where it used to take again and find nothing after each one."""
    q: DelayedQueue[Any] = DelayedQueue("ahead")
    handled: list[str] = []
    counter = ProcessCounter(q)
    worker = make_worker(pg, concurrency=2, poll_interval=30)
    worker.register(q, lambda env, session: handled.append(env.key), mode="transactional")
    with running(worker), producer_process(pg, "ahead") as offer_there:
        # The listener LISTENs, then wakes every consumer once; only it brings the warm-up in
        # (the poll is 30 s). Once that is handled and both consumers wait, counting starts.
        assert wait_for(lambda: listening(pg), 30)
        offer_there("warm-up")
        assert wait_for(lambda: handled == ["warm-up"], 30)
        assert wait_for(lambda: waiting(worker) == 2, 15)
        before = counter.settled()
        offered: list[str] = ["warm-up"]
        for i in range(10):
            offered.append(f"k{i}")
            offer_there(offered[-1])
            assert wait_for(lambda: len(handled) == len(offered), 15)
        assert wait_for(lambda: waiting(worker) == 2, 15)
        after = counter.settled()
    assert handled == offered
    assert (after[0] - before[0], after[1] - before[1]) == (10, 0)


def test_an_offer_from_another_process_during_a_transactional_handler_is_handled_at_once(
    server_backend, make_worker
):
    """The take of ``first`` saw nothing more; ``second``, offered by another process while
    ``first``'s handler runs, still starts within moments, not after the 30 s poll interval:
    its offer is a wake-up (PostgreSQL's listener), or the consumer takes again (MariaDB)."""
    q: DelayedQueue[Any] = DelayedQueue("ahead-cross")
    handled: list[tuple[str, float]] = []
    release = threading.Event()

    def handler(env: Envelope[Any], session: Session) -> None:
        handled.append((env.key, time.monotonic()))
        if env.key == "first":
            assert release.wait(30)

    worker = make_worker(server_backend, concurrency=1, poll_interval=30)
    worker.register(q, handler, mode="transactional")
    with running(worker), producer_process(server_backend, "ahead-cross") as offer_there:
        time.sleep(0.3)
        offer(server_backend, q, "first")
        assert wait_for(lambda: len(handled) == 1, 5)
        offer_there("second")
        offered = time.monotonic()
        release.set()
        assert wait_for(lambda: len(handled) == 2, 10)
    assert [k for k, _ in handled] == ["first", "second"]
    assert handled[1][1] - offered < 5.0


def test_a_transactional_consumer_sleeps_until_the_next_due_message_it_saw(backend, make_worker):
    """``later`` is due 1 s after ``now``: handled when due, not after the poll interval."""
    q: DelayedQueue[Any] = DelayedQueue("ahead-later")
    handled: list[tuple[str, datetime]] = []
    worker = make_worker(backend, concurrency=1, poll_interval=30)
    worker.register(
        q, lambda env, session: handled.append((env.key, utcnow())), mode="transactional"
    )
    with running(worker):
        time.sleep(0.3)
        due = utcnow() + timedelta(seconds=1)
        with backend.Session() as s, s.begin():
            q.offer(s, "later", {}, at=due)
            q.offer(s, "now", {})
        assert wait_for(lambda: len(handled) == 2, 15)
    assert [k for k, _ in handled] == ["now", "later"]
    assert due <= handled[1][1] <= due + timedelta(seconds=10)  # not the 30 s poll


def test_an_offer_to_another_queue_of_the_table_wakes_nobody(backend, make_worker):
    mine: DelayedQueue[Any] = DelayedQueue("mine")
    counter = TakeCounter(mine)
    worker = make_worker(backend, concurrency=2, poll_interval=30, listen=False)
    worker.register(mine, lambda env: None)
    with running(worker):
        assert wait_for(lambda: waiting(worker) == 2, 30)
        before = counter.settled()
        offer(backend, DelayedQueue("theirs"), "k")
        assert counter.settled() == before


def test_wake_payloads_carry_the_queue_and_the_count():
    assert parse_wake(wake_payload("q", 5)) == ("q", 5)
    assert parse_wake(wake_payload("a\x1fb", 1)) == ("a\x1fb", 1)
    assert parse_wake("q") == ("q", 1)  # what an insert carries
    assert parse_wake("12 q") == ("12 q", 1)
    assert parse_wake("") == (None, None)
    assert parse_wake(None) == (None, None)


def test_a_notification_from_another_connection_says_how_many_messages(pg):
    """The cross-process path: ``LISTEN`` hears each transaction's count per queue."""
    q: DelayedQueue[Any] = DelayedQueue("heard")
    heard: list[tuple[str | None, str | None, int | None]] = []
    listener = PostgreSQLStrategy.listener(pg.url, ["delayed_queue"], lambda *a: heard.append(a))
    assert listener is not None
    listener.start()
    try:
        assert wait_for(listener.connected.is_set, 10)  # type: ignore[attr-defined]
        assert wait_for(lambda: heard == [(None, None, None)], 5)  # connected: wake everyone
        with pg.Session() as s, s.begin():
            q.offer(s, "one", {})
        with pg.Session() as s, s.begin():
            q.offer_batch(s, [(f"b{i}", {}) for i in range(5)])
        with pg.Session() as s, s.begin():
            q.offer(s, "two-a", {})
            q.offer(s, "two-b", {})
            q.offer(s, "two-b", {})  # the same message again: ignored, not counted
        assert wait_for(lambda: len(heard) >= 5, 5)
        time.sleep(0.2)
    finally:
        listener.stop()
    counts = [("heard", 1), ("heard", 5), ("heard", 1), ("heard", 1)]
    assert heard[1:] == [("delayed_queue", *c) for c in counts]


def test_a_listener_on_an_asyncpg_url_with_its_own_parameters_connects(pg, caplog):
    """The listener (psycopg, libpq) got the async URL's query unchanged: libpq refused
    asyncpg's ``prepared_statement_cache_size`` every 5 s, for ever, and no offer of another
    process woke the worker. Keys libpq does not know are left out (and said so); asyncpg's
    ``ssl=<mode>`` becomes ``sslmode``."""
    url = pg.url.set(
        drivername="postgresql+asyncpg",
        query={"prepared_statement_cache_size": "0", "ssl": "disable"},
    )
    heard: list[tuple[str | None, str | None, int | None]] = []
    listener = PostgreSQLStrategy.listener(url, ["delayed_queue"], lambda *a: heard.append(a))
    assert listener is not None
    with caplog.at_level(logging.WARNING, logger="sqla_delayedq.listener"):
        listener.start()
        try:
            assert wait_for(listener.connected.is_set, 10)  # type: ignore[attr-defined]
            with pg.Session() as s, s.begin():
                DelayedQueue[Any]("heard-async").offer(s, "one", {})
            assert wait_for(lambda: ("delayed_queue", "heard-async", 1) in heard, 5)
        finally:
            listener.stop()
    dropped = [r.getMessage() for r in caplog.records if "leaves out" in r.getMessage()]
    assert len(dropped) == 1 and "prepared_statement_cache_size" in dropped[0]
    from sqla_delayedq._dialects import libpq_url

    assert libpq_url(url)[0].query == {"sslmode": "disable"}


# -- heartbeats -------------------------------------------------------------------------------


def test_a_long_lease_mode_handler_keeps_its_lease(backend, make_worker):
    q: DelayedQueue[Any] = DelayedQueue("heartbeat")
    delivered: list[Delivery] = []

    def handler(env: Envelope[Any]) -> None:
        delivered.append(env.delivery)
        time.sleep(7)  # two extensions (each one at half the lease left: at least 1 s to spare)

    hooks = RecordingHooks()
    worker = make_worker(backend, concurrency=2, poll_interval=0.1, listen=False, hooks=hooks)
    worker.register(q, handler, lease=timedelta(seconds=3))
    offer(backend, q, "long")
    with running(worker):
        assert wait_for(lambda: len(hooks.processed_) == 1, 30)
    assert delivered == [Delivery.FIRST]  # the second thread never got it
    assert hooks.redelivered_ == []
    assert pending(backend, q) == 0


def test_a_handler_past_its_timeout_loses_its_lease_and_is_redelivered(backend, make_worker):
    q: DelayedQueue[Any] = DelayedQueue("hung")
    delivered: list[tuple[Delivery, datetime, datetime]] = []
    finished: list[Delivery] = []

    def handler(env: Envelope[Any]) -> None:
        delivered.append((env.delivery, datetime.now(UTC), env.lease_until))
        if env.delivery is Delivery.FIRST:
            time.sleep(4)  # "hung": longer than handler_timeout plus a lease
        finished.append(env.delivery)

    hooks = RecordingHooks()
    worker = make_worker(backend, concurrency=2, poll_interval=0.1, listen=False, hooks=hooks)
    worker.register(
        q, handler, lease=timedelta(seconds=1.5), handler_timeout=timedelta(seconds=0.5)
    )
    offer(backend, q, "hung")
    with running(worker):
        assert wait_for(lambda: len(finished) == 2, 10)
    assert [d for d, _, _ in delivered] == [Delivery.FIRST, Delivery.REDELIVERY]
    # Not before the first lease ran out. The lease runs from the take, which comes before
    # the handler starts, so compare with the lease itself, not with the handler's start.
    first_lease_until = delivered[0][2]
    assert first_lease_until - delivered[0][1] <= timedelta(seconds=1.5)
    assert delivered[1][1] >= first_lease_until - timedelta(milliseconds=1)
    assert hooks.redelivered_ == [("hung", "hung")]
    assert [p[1] for p in hooks.processed_] == ["hung"]  # the hung attempt's ack was refused
    assert pending(backend, q) == 0


# -- hooks ------------------------------------------------------------------------------------


def test_hooks_report_processed_failed_redelivered_and_lag(backend, make_worker):
    # max_attempts=2: the abandoned take (its lease ran out) counts as the first attempt.
    q: DelayedQueue[Any] = DelayedQueue(
        "hooks", retry=ExponentialBackoff(max_attempts=2, initial=timedelta(hours=1))
    )
    offer(backend, q, "abandoned", {"fail": False})
    with backend.Session() as s, s.begin():  # a consumer takes it and never comes back
        assert q.try_poll(s, lease=timedelta(milliseconds=200)) is not None
    with backend.Session() as s, s.begin():
        q.offer(s, "late", {"fail": False}, at=utcnow() - timedelta(seconds=2))
        q.offer(s, "bad", {"fail": True})
    time.sleep(0.3)

    def handler(env: Envelope[Any]) -> None:
        if env.payload["fail"]:
            raise KeyError("no such thing")

    hooks = RecordingHooks()
    worker = make_worker(backend, concurrency=1, poll_interval=0.1, listen=False, hooks=hooks)
    worker.register(q, handler)
    with running(worker):
        assert wait_for(lambda: len(hooks.processed_) + len(hooks.failed_) >= 3, 10)
    assert sorted(p[1] for p in hooks.processed_) == ["abandoned", "late"]
    assert all(p[0] == "hooks" and p[2] >= 0 for p in hooks.processed_)
    [(queue, key, attempt, error, outcome)] = hooks.failed_
    assert (queue, key, attempt, outcome) == ("hooks", "bad", 1, NackOutcome.RETRY_SCHEDULED)
    assert isinstance(error, KeyError)
    assert hooks.redelivered_ == [("hooks", "abandoned")]
    assert len(hooks.lags) == 3 and all(queue == "hooks" for queue, _ in hooks.lags)
    assert all(seconds >= 0 for _, seconds in hooks.lags)
    assert max(seconds for _, seconds in hooks.lags) >= 2.0  # "late" was due 2 s before


def test_a_hook_left_as_worker_hooks_defines_it_is_skipped_and_every_override_runs():
    """The worker skips a hook that no hooks object overrides (and the work of its arguments,
    the clock read of ``lag``); an override of any form (a subclass's method, an attribute set
    on an instance) makes it run, for every hooks object that has one."""
    from sqla_delayedq._consumer import SafeHooks, wants

    calls: list[str] = []

    class OnlyProcessed(WorkerHooks):
        def processed(self, queue: str, envelope: Envelope[Any], seconds: float) -> None:
            calls.append("processed")

    safe = SafeHooks(OnlyProcessed(), call=lambda hook, *args: hook(*args))
    assert wants(safe, "processed") and not wants(safe, "lag")
    assert not wants(WorkerHooks(), "failed")
    by_attribute = WorkerHooks()
    by_attribute.lag = lambda queue, seconds: calls.append("lag")  # type: ignore[method-assign]
    safe.all.append(by_attribute)
    assert wants(safe, "lag") and wants(by_attribute, "lag")
    safe.lag("q", 1.0)
    safe.processed("q", cast(Envelope[Any], None), 0.1)
    safe.failed("q", cast(Envelope[Any], None), KeyError("x"), NackOutcome.DEAD)
    assert calls == ["lag", "processed"]


# -- stopping ---------------------------------------------------------------------------------


def test_stop_waits_for_in_flight_handlers(backend, make_worker):
    q: DelayedQueue[Any] = DelayedQueue("drain")
    started, finished = threading.Event(), threading.Event()

    def handler(env: Envelope[Any]) -> None:
        started.set()
        time.sleep(0.5)
        finished.set()

    hooks = RecordingHooks()
    worker = make_worker(backend, concurrency=1, poll_interval=0.1, listen=False, hooks=hooks)
    worker.register(q, handler)
    offer(backend, q, "m")
    worker.start()
    try:
        assert started.wait(5)
    finally:
        assert worker.stop(drain_timeout=5) is True
    assert finished.is_set()
    assert [p[1] for p in hooks.processed_] == ["m"]
    assert pending(backend, q) == 0


def test_stop_releases_what_outlives_the_drain_timeout(backend, make_worker):
    """Released without an attempt, due when a lease from the stop ends: not at once, since
    the handler still runs (a thread cannot be killed) and another consumer would run the
    message beside it."""
    q: DelayedQueue[Any] = DelayedQueue("stuck")
    started, release, returned = threading.Event(), threading.Event(), threading.Event()

    def handler(env: Envelope[Any]) -> None:
        started.set()
        release.wait(10)
        returned.set()

    hooks = RecordingHooks()
    worker = make_worker(backend, concurrency=1, poll_interval=0.1, listen=False, hooks=hooks)
    worker.register(q, handler, lease=timedelta(minutes=5))
    offer(backend, q, "m")
    worker.start()
    try:
        assert started.wait(5)
        stopped = utcnow()
        assert worker.stop(drain_timeout=0.3) is False
        with backend.Session() as s:
            info = q.get(s, "m")
        assert info is not None and info.lock_token is None  # released, uncounted ...
        assert info.attempts == 0 and info.state is State.SCHEDULED
        # ... due when a lease (5 minutes) from the stop ends, not beside its running handler
        assert info.scheduled_at is not None
        assert (
            stopped + timedelta(minutes=5) <= info.scheduled_at <= utcnow() + timedelta(minutes=5)
        )
    finally:
        release.set()
        assert returned.wait(5)
    time.sleep(0.2)  # the late ack, refused
    assert hooks.processed_ == []
    assert pending(backend, q) == 1


@pytest.mark.parametrize("how", ["stop", "process_due"])
def test_a_handler_that_runs_on_through_a_stop_or_process_due_keeps_its_lease(
    backend, make_worker, how
):
    """A handler longer than its lease, running while the worker drains (a graceful stop) or
    inside ``process_due``: the heartbeat went with the stop request (and never ran for
    ``process_due``), so its lease ran out, another worker ran the message beside it, and with
    one attempt allowed the message died while its handler succeeded."""
    retry = ExponentialBackoff(max_attempts=1, initial=timedelta(hours=1), jitter=0)
    q: DelayedQueue[Any] = DelayedQueue("long-drain", lease=timedelta(seconds=1), retry=retry)
    offer(backend, q, "m")
    started = threading.Event()
    ran: list[str] = []

    def slow(env: Envelope[Any]) -> None:
        ran.append("slow")
        started.set()
        time.sleep(2.5)  # two and a half leases

    def other(env: Envelope[Any]) -> None:
        ran.append("other")

    hooks = RecordingHooks()
    first = make_worker(backend, concurrency=1, poll_interval=0.05, listen=False, hooks=hooks)
    first.register(q, slow)
    second = make_worker(backend, concurrency=1, poll_interval=0.05, listen=False)
    second.register(q, other)
    if how == "stop":
        first.start()
        assert started.wait(10)
        with running(second):
            assert first.stop(drain_timeout=30) is True
            time.sleep(0.3)
    else:
        done = threading.Thread(target=lambda: ran.append(f"due:{first.process_due(1)}"))
        done.start()
        assert started.wait(10)
        with running(second):
            done.join(30)
            time.sleep(0.3)
        assert ran[-1] == "due:1"
    assert ran.count("slow") == 1 and "other" not in ran, ran
    assert len(hooks.processed_) == 1
    assert pending(backend, q) == 0  # acknowledged: neither run again nor dead


def test_a_deadlock_a_transactional_handler_wraps_is_retried_not_fatal(mariadb, make_worker):
    """InnoDB picks the handler's transaction as a deadlock victim and rolls all of it back (the
    take too); the handler wraps the error in one of its own, as applications do. The savepoint
    is gone, so the attempt cannot be recorded: the message is due again, uncounted, and the
    worker goes on. It used to stop on the handler's own (non-transient) error."""
    meta = sa.MetaData()
    acct = sa.Table("deadlock_acct", meta, sa.Column("id", sa.Integer, primary_key=True))
    heavy = sa.Table("deadlock_heavy", meta, sa.Column("id", sa.Integer, primary_key=True))
    meta.create_all(mariadb.engine)
    try:
        with mariadb.engine.begin() as conn:
            conn.execute(acct.insert(), [{"id": 1}, {"id": 2}])
        q: DelayedQueue[Any] = DelayedQueue("deadlocked")
        offer(mariadb, q, "m")
        calls: list[int] = []
        other_ready = threading.Event()

        class AppError(Exception):
            pass

        def other() -> None:  # a transaction InnoDB spares (it wrote more rows)
            with mariadb.engine.connect() as c:
                c.begin()
                c.execute(heavy.insert(), [{"id": i} for i in range(1, 301)])
                c.execute(sa.text("UPDATE deadlock_acct SET id = id WHERE id = 2"))
                other_ready.set()
                time.sleep(0.3)
                c.execute(sa.text("UPDATE deadlock_acct SET id = id WHERE id = 1"))
                c.rollback()

        def handler(env: Envelope[Any], session: Any) -> None:
            calls.append(1)
            if len(calls) > 1:
                return
            session.execute(sa.text("UPDATE deadlock_acct SET id = id WHERE id = 1"))
            threading.Thread(target=other, daemon=True).start()
            assert other_ready.wait(10)
            try:
                session.execute(sa.text("UPDATE deadlock_acct SET id = id WHERE id = 2"))
            except sa.exc.OperationalError as exc:
                raise AppError("could not update the account") from exc

        worker = make_worker(mariadb, concurrency=1, poll_interval=0.05, listen=False)
        worker.register(q, handler, mode="transactional")
        with running(worker):
            assert wait_for(lambda: len(calls) >= 2 and pending(mariadb, q) == 0, 30)
        assert len(calls) == 2
    finally:
        meta.drop_all(mariadb.engine)


def test_a_limited_transactional_take_whose_connection_dies_is_due_again_at_once(
    server_backend, make_worker
):
    """A limited queue's transactional take is a lease committed apart. When the handler's
    transaction is lost (its connection killed), the message must be due again at once and
    uncounted, as for a plain transactional take, not held for a whole lease and then counted
    as a lost attempt (dead at once with one attempt allowed, its handler never succeeding)."""
    retry = ExponentialBackoff(max_attempts=1, initial=timedelta(hours=1), jitter=0)
    q: DelayedQueue[Any] = DelayedQueue("limited-killed", lease=timedelta(minutes=5), retry=retry)
    with server_backend.Session() as s, s.begin():
        q.set_limits(s, max_in_flight=5)
    offer(server_backend, q, "m")
    calls: list[tuple[int, Delivery]] = []
    pg = server_backend.name == "postgresql"

    def handler(env: Envelope[Any], session: Any) -> None:
        calls.append((env.attempt, env.delivery))
        if len(calls) > 1:
            return
        me = session.execute(sa.text("SELECT pg_backend_pid()" if pg else "SELECT CONNECTION_ID()"))
        pid = me.scalar_one()
        with server_backend.engine.connect() as killer:
            kill = f"SELECT pg_terminate_backend({pid})" if pg else f"KILL {pid}"
            killer.execute(sa.text(kill))
        time.sleep(0.2)

    worker = make_worker(server_backend, concurrency=1, poll_interval=0.05, listen=False)
    worker.register(q, handler, mode="transactional")
    with running(worker):
        assert wait_for(lambda: pending(server_backend, q) == 0, 30)
    assert calls == [(1, Delivery.FIRST), (1, Delivery.FIRST)]


def test_a_settle_whose_commit_reply_was_lost_says_what_the_message_may_be(
    backend, make_worker, caplog
):
    """A handler fails for good (one attempt allowed); the settle that buries the message
    commits, but its reply is lost (injected after the commit), so the settle runs again and is
    refused by its token. That was logged as a failure "not recorded" (a warning), while the
    message was dead: now an error says the outcome is unknown and that it may be dead."""
    retry = ExponentialBackoff(max_attempts=1, initial=timedelta(hours=1), jitter=0)
    q: DelayedQueue[Any] = DelayedQueue("lost-reply", retry=retry)
    offer(backend, q, "m")
    armed: list[bool] = []

    def lose_the_reply(session: Session) -> None:
        if armed and armed.pop():
            raise TransientError("injected: the connection was lost after COMMIT")

    def handler(env: Envelope[Any]) -> None:
        armed.append(True)  # the next commit is this failure's settle
        raise ValueError("permanent failure")

    sa.event.listen(Session, "after_commit", lose_the_reply)
    try:
        # No side task that commits (the statistics keeper) may take the injected error.
        worker = make_worker(
            backend, concurrency=1, poll_interval=0.05, listen=False, keep_statistics=False
        )
        worker.register(q, handler)
        with caplog.at_level("WARNING", logger="sqla_delayedq"), running(worker):
            assert wait_for(lambda: "outcome is unknown" in caplog.text, 30)
    finally:
        sa.event.remove(Session, "after_commit", lose_the_reply)
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert any("may be dead (attempt 1 of 1 failed)" in m for m in errors), errors
    with backend.Session() as s:
        info = q.get(s, "m")
    assert info is not None and info.state is State.DEAD


@pytest.mark.parametrize("shape", ["single", "batch", "chained"])
def test_a_take_whose_commit_reply_was_lost_delivers_what_it_took(
    backend, make_worker, shape, caplog
):
    """A take commits but its reply is lost (the connection dropped after COMMIT). The worker
    took it for a failed take: its messages stayed leased under a token nobody held until the
    lease ran out, which counted as an attempt: with one attempt allowed they died ("lease ran
    out") though no handler had run. The worker now reads whether the take committed and, as
    it did, runs their handlers: each exactly once, none dead. ``chained``: the take that rides
    in the first message's acknowledgement (a full take chains the next)."""
    from sqla_delayedq._dialects import TAKE_ONLY

    retry = ExponentialBackoff(max_attempts=1, initial=timedelta(hours=1), jitter=0)
    q: DelayedQueue[Any] = DelayedQueue(
        f"lost-take-{shape}", lease=timedelta(seconds=1), retry=retry
    )
    keys = ["a", "b", "c"] if shape == "batch" else ["a", "b"] if shape == "chained" else ["a"]
    for key in keys:
        offer(backend, q, key)
    calls: list[str] = []
    chained = shape == "chained"

    def handle(*keys: str) -> None:
        calls.extend(keys)
        if chained and len(calls) == 1:
            armed.append(True)  # the next commit is this acknowledgement and the next take

    def take(session: Session) -> bool:
        return chained or bool(session.info.get(TAKE_ONLY))

    with losing_a_commit_reply(take) as armed:
        if not chained:
            armed.append(True)
        # No side task that commits (the statistics keeper) may take the injected error.
        worker = make_worker(
            backend, concurrency=1, poll_interval=0.05, listen=False, keep_statistics=False
        )
        if shape == "batch":
            worker.register_batch(q, lambda envs: handle(*(e.key for e in envs)), batch_size=10)
        else:
            worker.register(q, lambda env: handle(env.key))
        with caplog.at_level("INFO", logger="sqla_delayedq"), running(worker):
            assert wait_for(lambda: pending(backend, q) == 0, 15)
    assert not armed, "the injected fault never hit"
    assert sorted(calls) == keys  # each handler ran, once
    with backend.Session() as s:
        assert q.counts(s).dead == 0
    # The fault hit a take: read back after the failed commit, or (PostgreSQL's fused
    # acknowledgement and take, one autocommit statement) known to have committed, as it returned.
    assert "committed, though" in caplog.text or "returned, then its session" in caplog.text


def test_a_take_whose_commit_outcome_cannot_be_read_says_so(backend, make_worker, caplog):
    """The take's commit failed where it may have happened, and the database cannot be read
    until the lease: the worker goes on as before (if the take committed, its lease runs out
    and counts as an attempt) and an error says so, with the keys."""
    from sqla_delayedq._dialects import TAKE_ONLY

    q: DelayedQueue[Any] = DelayedQueue("lost-take-unread", lease=timedelta(seconds=1))
    offer(backend, q, "m")
    calls: list[tuple[int, Delivery]] = []

    def unreadable(session: Session, envelopes: Any) -> Any:
        raise TransientError("injected: the database is unreachable")

    q.holding = unreadable  # type: ignore[method-assign]
    with losing_a_commit_reply(lambda s: bool(s.info.get(TAKE_ONLY))) as armed:
        armed.append(True)
        worker = make_worker(
            backend, concurrency=1, poll_interval=0.05, listen=False, keep_statistics=False
        )
        worker.register(q, lambda env: calls.append((env.attempt, env.delivery)))
        with caplog.at_level("WARNING", logger="sqla_delayedq"), running(worker):
            assert wait_for(lambda: pending(backend, q) == 0, 15)
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert any("cannot be read" in m and "counts as an attempt" in m and ": m" in m for m in errors)
    assert calls == [(2, Delivery.REDELIVERY)]  # it had committed: the lost lease counted


def test_a_limited_transactional_take_whose_commit_reply_was_lost_is_due_again_uncounted(
    server_backend, make_worker, caplog
):
    """A limited queue's transactional take commits its lease apart. When that commit's reply
    was lost, the lease stayed under a token nobody held until it ran out, then counted as an
    attempt: dead with one attempt allowed, the handler never run. The take is now found
    committed and released, uncounted: the handler runs once, on a first delivery."""
    retry = ExponentialBackoff(max_attempts=1, initial=timedelta(hours=1), jitter=0)
    q: DelayedQueue[Any] = DelayedQueue(
        "limited-lost-take", lease=timedelta(seconds=1), retry=retry
    )
    with server_backend.Session() as s, s.begin():
        q.set_limits(s, max_in_flight=5)
    offer(server_backend, q, "m")
    calls: list[tuple[int, Delivery]] = []

    def handler(env: Envelope[Any], session: Any) -> None:
        calls.append((env.attempt, env.delivery))

    # The worker's first commit is the take's lease (no side task commits before it).
    with losing_a_commit_reply(lambda s: True) as armed:
        armed.append(True)
        worker = make_worker(
            server_backend, concurrency=1, poll_interval=0.05, listen=False, keep_statistics=False
        )
        worker.register(q, handler, mode="transactional")
        with caplog.at_level("INFO", logger="sqla_delayedq"), running(worker):
            assert wait_for(lambda: pending(server_backend, q) == 0, 15)
    assert not armed, "the injected fault never hit"
    assert calls == [(1, Delivery.FIRST)]
    with server_backend.Session() as s:
        assert q.counts(s).dead == 0
    assert "committed, though" in caplog.text  # the fault hit the take


@pytest.mark.parametrize("shape", ["single", "batch"])
def test_a_failed_lease_mode_attempt_is_retried_after_its_delay_not_a_poll_interval(
    backend, make_worker, shape
):
    """The consumer used what its take had read of the queue's next due row, before the nack
    moved the failed message to its retry time: it slept a whole poll interval (5 s by
    default) past a 1 s retry. It now looks again after a failure, as transactional mode
    does. (Two consumers: the other's wake-up cannot hide it.)"""
    retry = ExponentialBackoff(max_attempts=3, initial=timedelta(milliseconds=300), jitter=0)
    q: DelayedQueue[Any] = DelayedQueue("retried-soon", retry=retry)
    times: list[float] = []

    def handle(attempt: int) -> None:
        times.append(time.monotonic())
        if attempt == 1:
            raise RuntimeError("the first attempt fails")

    worker = make_worker(backend, concurrency=2, poll_interval=4.0, listen=False)
    if shape == "batch":
        worker.register_batch(q, lambda envs: handle(envs[0].attempt), batch_size=10)
    else:
        worker.register(q, lambda env: handle(env.attempt))
    with running(worker):
        time.sleep(0.3)  # both consumers idle
        offer(backend, q, "k")
        assert wait_for(lambda: len(times) >= 2, 15)
    assert times[1] - times[0] < 2.0, times  # the 0.3 s retry, far from the 4 s poll


def test_a_message_updated_in_flight_starts_as_soon_as_the_old_delivery_ends(backend, make_worker):
    """The old delivery's ack ends the hold: the new version is due at once, and an idle
    consumer, which read the old lease's end as the next due time, is woken for it."""
    q: DelayedQueue[Any] = DelayedQueue("held-then-due", lease=timedelta(seconds=30))
    events: list[tuple[str, int, float]] = []
    updated = threading.Event()

    def handler(env: Envelope[Any]) -> None:
        v = env.payload["v"]
        events.append(("start", v, time.monotonic()))
        if v == 1:
            assert updated.wait(10)
            time.sleep(0.5)  # the idle consumer polls meanwhile: held
        events.append(("end", v, time.monotonic()))

    worker = make_worker(backend, concurrency=2, poll_interval=4.0, listen=False)
    worker.register(q, handler)
    with running(worker):
        time.sleep(0.3)
        offer(backend, q, "k", {"v": 1})
        assert wait_for(lambda: len(events) >= 1, 10)
        offer(backend, q, "k", {"v": 2})
        updated.set()
        assert wait_for(lambda: len(events) >= 4, 15)
    (_, _, old_end), (_, _, new_start) = events[1], events[2]
    assert [e[:2] for e in events] == [("start", 1), ("end", 1), ("start", 2), ("end", 2)]
    assert new_start - old_end < 2.0, events  # not a 4 s poll later


def test_a_handler_failing_with_no_retry_delay_does_not_spin_or_starve_other_queues(
    backend, make_worker
):
    """Looking again after a failure must not be at once: a message whose retry is due at once
    (a zero delay) was taken in a busy loop, hammering the database and starving the queues
    registered after it."""
    zero = ExponentialBackoff(initial=timedelta(0), multiplier=1, max_attempts=10**6, jitter=0)
    failing: DelayedQueue[Any] = DelayedQueue("always-fails", retry=zero)
    other: DelayedQueue[Any] = DelayedQueue("served-too")
    attempts: list[int] = []
    served = threading.Event()

    def fail(env: Envelope[Any]) -> None:
        attempts.append(env.attempt)
        raise RuntimeError("fails every time")

    worker = make_worker(backend, concurrency=1, poll_interval=1.0, listen=False)
    worker.register(failing, fail)
    worker.register(other, lambda env: served.set())
    offer(backend, failing, "poison")
    with running(worker):
        assert wait_for(lambda: len(attempts) >= 2, 10)
        offer(backend, other, "m")
        started = time.monotonic()
        assert served.wait(5)
        time.sleep(max(0.0, 1.0 - (time.monotonic() - started)))
    assert len(attempts) < 300, len(attempts)  # about 20 a second, not thousands


def test_request_stop_during_process_due_ends_it_without_taking_again(backend):
    """``request_stop()`` while ``process_due`` runs (a cron job's SIGTERM handler, or a
    cancelled asyncio call beside it on the same worker): it returns with what its handlers
    handled, and what it took but did not start is given back, uncounted. It went on taking,
    gave each message back unhandled and counted it as handled: without a limit it never
    returned (found in review)."""
    q: DelayedQueue[Any] = DelayedQueue("stopped-due", lease=timedelta(minutes=5))
    with backend.Session.begin() as s:
        q.offer_batch(s, [(f"m{i}", {}) for i in range(5)])
    handled: list[str] = []
    worker = Worker(backend.Session, listen=False, keep_statistics=False, batch_size=5)

    def handler(env: Envelope[Any]) -> None:
        handled.append(env.key)
        worker.request_stop()

    worker.register(q, handler, mode="lease")
    assert worker.process_due(limit=50) == 1  # the spin stopped at the limit, 50 "handled"
    assert len(handled) == 1
    with backend.Session() as s:
        rest = [q.get(s, f"m{i}") for i in range(5) if f"m{i}" not in handled]
    assert all(i is not None and i.lock_token is None and i.attempts == 0 for i in rest)
    assert all(i is not None and i.state is State.DUE for i in rest)


#: A thread worker of 32 idle consumers that prints "ready", then runs until signalled.
SIGNALLED = """
import sys, time, threading
from sqlalchemy.orm import sessionmaker
from sqla_delayedq import DelayedQueue, create_engine
from sqla_delayedq.models import metadata
from sqla_delayedq.worker import Worker
engine = create_engine(sys.argv[1])
metadata.create_all(engine)
w = Worker(sessionmaker(engine), listen=False, concurrency=32, drain_timeout=2, poll_interval=30)
w.register(DelayedQueue("signalled"), lambda env: None)
def ready():
    while w._rt is None or len(w._rt._waiting) < 32:
        time.sleep(0.01)
    print("ready", flush=True)
threading.Thread(target=ready, daemon=True).start()
w.run()
print("stopped", flush=True)
"""


def test_run_off_the_main_thread_says_to_leave_the_signal_handlers_alone(backend):
    """``Worker.run()`` off the main thread failed with Python's ``ValueError: signal only
    works in main thread``, which did not say what to do."""
    worker = Worker(backend.Session, poll_interval=0.05, listen=False)
    worker.register(DelayedQueue("off-main"), lambda env: None)
    failures: list[BaseException] = []

    def run() -> None:
        try:
            worker.run()
        except Exception as exc:
            failures.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    assert len(failures) == 1 and isinstance(failures[0], InvalidArgument)
    assert "install_signal_handlers=False" in str(failures[0])
    assert not worker._started


def test_a_thread_worker_stops_on_a_second_signal_during_the_first_s_stop(tmp_path):
    """Ctrl-C on ``delayedq worker -p N`` sends each child SIGINT, and the supervisor then
    SIGTERM: a thread worker's signal handler asked for the stop itself, taking a lock of the
    runtime's, and the second signal's handler, run on the same thread while the first held it,
    waited on it for ever (about half of such runs hung; found in review). Each of ten runs
    now stops."""
    import random
    import signal

    gaps = random.Random(7)
    hung = []
    for i in range(10):
        url = f"sqlite:///{tmp_path / f'signalled{i}.db'}"
        proc = subprocess.Popen(
            [sys.executable, "-c", SIGNALLED, url], stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout is not None
        try:
            assert proc.stdout.readline().strip() == "ready"
            gap = gaps.random() * 300e-6  # the second lands while the first's handler runs
            proc.send_signal(signal.SIGINT)
            sent = time.perf_counter()
            while time.perf_counter() - sent < gap:
                pass
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                hung.append(i)
        finally:
            proc.kill()
            proc.wait()
    assert hung == []


def test_request_stop_alone_ends_the_heartbeat_with_the_last_consumer(backend):
    """A worker told to stop (request_stop, or its own stop on a fatal error) without stop()
    being called: once every consumer has ended, the heartbeat ends too, not run for ever."""
    worker = Worker(backend.Session, concurrency=2, poll_interval=0.05, listen=False)
    worker.register(DelayedQueue("nothing-due"), lambda env: None)
    worker.start()
    try:
        worker.request_stop()
        assert wait_for(lambda: not any(t.is_alive() for t in worker._threads), 5)
    finally:
        worker.stop(1)


def test_a_chained_take_failing_before_its_commit_logs_no_unknown_outcome(
    backend, make_worker, caplog
):
    """The take chained to an acknowledgement fails before the commit (a transient error of its
    statement): nothing committed, so an acknowledgement then refused for a normal reason (an
    offer updated the message meanwhile) is a warning, not an "outcome unknown" error."""
    q: DelayedQueue[Any] = DelayedQueue("chain-then-refused")
    with backend.Session() as s, s.begin():
        q.offer_batch(s, [("m0", {"v": 1}), ("m1", {"v": 1})])
    real = q.poll_batch
    calls: list[int] = []

    def flaky(session: Session, n: int, **kw: Any) -> Any:
        calls.append(n)
        if len(calls) == 2:  # the take chained to m0's acknowledgement
            raise TransientError("injected: a statement timeout")
        return real(session, n, **kw)

    q.poll_batch = flaky  # type: ignore[method-assign]
    unfused(q)

    def handler(env: Envelope[Any]) -> None:
        if env.key == "m0" and env.payload == {"v": 1}:
            offer(backend, q, "m0", {"v": 2})  # held: m0's own ack will be refused

    worker = make_worker(backend, concurrency=1, poll_interval=0.05, listen=False)
    worker.register(q, handler, mode="lease")
    with caplog.at_level("WARNING", logger="sqla_delayedq"), running(worker):
        assert wait_for(lambda: pending(backend, q) == 0, 30)
    assert len(calls) >= 2
    assert "refused" in caplog.text
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text


def test_a_worker_starts_once(backend):
    """start() twice left the first start's threads running after stop(), in a busy loop (they
    looked at the second start's stopped runtime); start() after stop() started threads that
    ended at once, without a word."""
    q: DelayedQueue[Any] = DelayedQueue("once")
    worker = Worker(backend.Session, concurrency=2, poll_interval=0.1, name="starts-once")
    worker.register(q, lambda env: None)
    worker.start()
    try:
        with pytest.raises(InvalidArgument, match="already running"):
            worker.start()
        with pytest.raises(InvalidArgument, match="already running"):
            worker.process_due()
    finally:
        assert worker.stop(5)
    alive = [t.name for t in threading.enumerate() if t.name.startswith("starts-once-")]
    assert alive == []
    with pytest.raises(InvalidArgument, match="starts once"):
        worker.start()


def test_a_queue_registered_twice_is_refused(backend):
    """Accepted before: the queue's messages went to either handler, whichever consumer took
    them (another DelayedQueue object of the same name and table is the same queue)."""
    worker = Worker(backend.Session).register(DelayedQueue("emails"), lambda env: None)
    for again in (DelayedQueue("emails"), DelayedQueue("emails", lease=timedelta(seconds=9))):
        with pytest.raises(InvalidArgument, match="registered already"):
            worker.register(again, lambda env: None)
        with pytest.raises(InvalidArgument, match="registered already"):
            worker.register_batch(again, lambda envs: None)
    worker.register(DelayedQueue("sms"), lambda env: None)  # another queue of the table
    assert [q.name for q in worker.queues] == ["emails", "sms"]


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_worker_options_that_are_no_finite_number_are_refused(backend, value):
    """Accepted before: a poll interval of inf ended every consumer thread on an OverflowError
    from its first wait (the worker seemed to run, and took nothing); a drain timeout of inf
    made stop() raise it before releasing what handlers held; NaN passed every range check."""
    for option in ("poll_interval", "drain_timeout"):
        with pytest.raises(InvalidArgument, match="finite"):
            Worker(backend.Session, **{option: value})
    worker = Worker(backend.Session).register(DelayedQueue("q"), lambda env: None)
    with pytest.raises(InvalidArgument, match="finite"):
        worker.add_periodic("tick", lambda sessions: None, value)
    with pytest.raises(InvalidArgument, match="finite"):
        worker.stop(value)


def test_worker_seconds_longer_than_a_thread_can_wait_are_refused(backend):
    """Accepted before: a poll interval of 1e10 seconds ended every consumer thread on an
    OverflowError from its first wait ("timeout value is too large"), as an interval did its
    side task's, and a drain timeout did the stop's join."""
    value: Any = threading.TIMEOUT_MAX * 2
    for option in ("poll_interval", "drain_timeout"):
        with pytest.raises(InvalidArgument, match=f"{option} must be at most"):
            Worker(backend.Session, **{option: value})
    Worker(backend.Session, poll_interval=threading.TIMEOUT_MAX)  # the longest is fine
    worker = Worker(backend.Session).register(DelayedQueue("q"), lambda env: None)
    with pytest.raises(InvalidArgument, match="interval must be at most"):
        worker.add_periodic("tick", lambda sessions: None, value)
    with pytest.raises(InvalidArgument, match="drain_timeout must be at most"):
        worker.stop(value)


# -- side tasks and extra hooks ---------------------------------------------------------------


def test_periodic_tasks_and_extra_hooks_run_with_the_worker(backend, make_worker):
    q: DelayedQueue[Any] = DelayedQueue("side-tasks")
    passes: list[int] = []
    stopped: list[int] = []
    extra = RecordingHooks()

    def tick(sessions: Any) -> None:
        with sessions() as s:  # a Session on the worker's database
            passes.append(int(s.execute(sa.text("SELECT 1")).scalar_one()))

    def bye(sessions: Any) -> None:
        stopped.append(1)

    worker = make_worker(backend, concurrency=1, poll_interval=0.1, listen=False)
    inner = getattr(worker, "worker", worker)  # the AsyncWorker behind the runner
    inner.add_periodic("probe", tick, 0.1, on_stop=bye).add_hooks(extra)
    worker.register(q, lambda env: None)
    offer(backend, q, "m")
    with running(worker):
        assert wait_for(lambda: len(passes) >= 3 and len(extra.processed_) == 1, 10)
    assert stopped == [1]
    assert [p[1] for p in extra.processed_] == ["m"]


class Bail(BaseException):
    """A custom ``BaseException``: neither an ``Exception`` nor an interruption."""


@pytest.mark.parametrize("raised", [SystemExit, Bail], ids=["exit", "custom"])
def test_hooks_and_periodic_tasks_raising_a_base_exception_never_stop_the_worker(
    backend, make_worker, raised, caplog
):
    """Documented: a raising hook never stops the worker, and a failing periodic task runs
    again. Only an ``Exception`` was caught: a hook's ``SystemExit`` stopped the worker
    (``WorkerError``) after the first message, and a periodic task's ended that task for good
    (its thread or task gone without a word, the worker running on without it)."""

    class BailingHooks(WorkerHooks):
        def processed(self, queue: str, envelope: Envelope[Any], seconds: float) -> None:
            raise raised("the hook bails out")

        def lag(self, queue: str, seconds: float) -> None:
            raise raised("the hook bails out")

    q: DelayedQueue[Any] = DelayedQueue("bailing-hooks")
    with backend.Session.begin() as s:
        q.offer_batch(s, [(f"k{i}", {}) for i in range(3)])
    handled: list[str] = []
    ticks: list[int] = []
    stops: list[int] = []

    def tick(sessions: Any) -> None:
        ticks.append(1)
        raise raised("the periodic task bails out")

    def bye(sessions: Any) -> None:
        stops.append(1)
        raise raised("its on_stop bails out")

    worker = make_worker(
        backend, concurrency=1, poll_interval=0.05, listen=False, hooks=BailingHooks()
    )
    getattr(worker, "worker", worker).add_periodic("bails", tick, 0.05, on_stop=bye)
    worker.register(q, lambda env: handled.append(env.key))
    caplog.set_level(logging.WARNING, logger="sqla_delayedq")
    with running(worker):  # stop() raises WorkerError if the worker stopped on an error
        assert wait_for(lambda: len(handled) == 3 and len(ticks) >= 3, 20)
    assert getattr(worker, "worker", worker).failure is None
    assert sorted(handled) == ["k0", "k1", "k2"]
    assert stops == [1]
    assert pending(backend, q) == 0  # each acknowledged, whatever its hooks raised
    logged = [r for r in caplog.records if r.exc_info and isinstance(r.exc_info[1], raised)]
    assert len(logged) >= 3 + 3 + 3 + 1  # processed, lag, ticks, on_stop: each with its trace


def test_a_keyboard_interrupt_from_a_hook_still_stops_the_worker(backend, make_worker):
    """Hooks swallow every error but an interruption, which keeps its meaning: the worker
    stops with it, loudly, as on a handler's ``KeyboardInterrupt``."""

    class Interrupting(WorkerHooks):
        def processed(self, queue: str, envelope: Envelope[Any], seconds: float) -> None:
            raise KeyboardInterrupt

    q: DelayedQueue[Any] = DelayedQueue("interrupting-hook")
    offer(backend, q, "m")
    worker = make_worker(
        backend, concurrency=1, poll_interval=0.05, listen=False, hooks=Interrupting()
    )
    worker.register(q, lambda env: None)
    error = stopped_by(worker, lambda: True, 20)
    assert isinstance(error, KeyboardInterrupt)


# -- the lease take's commit (PostgreSQL) ---------------------------------------------------


def _synchronous_commit(session: Session) -> str:
    return str(session.execute(sa.text("SHOW synchronous_commit")).scalar_one())


def test_only_a_take_only_transaction_commits_without_waiting_for_the_flush(pg, make_queue):
    """A lease take the worker runs alone in its transaction turns ``synchronous_commit`` off
    for that transaction (lost in a server crash, it is taken again, like an expired lease);
    a user's take in a transaction of their own, an empty take and a limited queue's take
    (whose controls record must last) keep the server's setting."""
    from sqla_delayedq._dialects import TAKE_ONLY

    q, limited = make_queue("q"), make_queue("limited")
    with pg.Session() as s, s.begin():
        q.offer_batch(s, [(f"k{i}", {}, None) for i in range(3)])
        limited.offer(s, "k", {})
        limited.set_limits(s, max_in_flight=5)
    with pg.Session() as s, s.begin():
        assert q.try_poll(s) is not None
        assert _synchronous_commit(s) == "on"
    with pg.Session() as s, s.begin():
        s.info[TAKE_ONLY] = True
        assert len(q.poll_batch(s, 1).envelopes) == 1
        assert _synchronous_commit(s) == "off"
    with pg.Session() as s, s.begin():
        s.info[TAKE_ONLY] = True
        assert make_queue("empty").poll_batch(s, 1).envelopes == []
        assert _synchronous_commit(s) == "on"
    with pg.Session() as s, s.begin():
        s.info[TAKE_ONLY] = True
        assert len(limited.poll_batch(s, 1).envelopes) == 1
        assert _synchronous_commit(s) == "on"


def test_a_lease_worker_relaxes_its_takes_commits_and_not_its_acks(pg, monkeypatch):
    """Every commit of a lease-mode worker, with the setting it ran under: the takes' are
    relaxed, every acknowledgement waits for the flush, and every message is handled once.
    A statement that commits on its own (autocommit: a take, an acknowledgement, or both in
    one) is relaxed when it says so itself."""
    from sqla_delayedq import controls

    # The controls picture stays fresh, so every acknowledgement goes alone (a slow machine
    # let it go stale mid-run, and one went through a transaction: a flaky count below).
    monkeypatch.setattr(controls, "REFRESH", 600.0)
    monkeypatch.setattr(controls, "MIN_REFRESH", 600.0)
    commits: list[tuple[str, str]] = []

    def on_commit(conn: Any) -> None:
        cursor = conn.connection.dbapi_connection.cursor()
        cursor.execute("SHOW synchronous_commit")
        commits.append((cursor.fetchone()[0], "transaction"))

    def on_statement(conn: Any, cursor: Any, statement: str, params: Any, *args: Any) -> None:
        if conn.get_execution_options().get("isolation_level") != "AUTOCOMMIT":
            return
        text = statement.lstrip()
        kind = "ack" if text.startswith(("WITH acked AS", "DELETE")) else "take"
        relaxed = "synchronous_commit" in f"{text} {params}"
        commits.append(("off" if relaxed else "on", kind))

    queue: DelayedQueue[Any] = DelayedQueue("q")
    with pg.Session() as s, s.begin():
        queue.offer_batch(s, [(f"k{i}", {"i": i}, None) for i in range(6)])
    handled: list[str] = []
    sa.event.listen(pg.engine, "commit", on_commit)
    sa.event.listen(pg.engine, "before_cursor_execute", on_statement)
    try:
        worker = Worker(pg.Session, concurrency=1, poll_interval=0.2, keep_statistics=False)
        worker.register(queue, lambda e: handled.append(e.key), mode="lease")
        with running(worker):
            deadline = time.monotonic() + 20
            while len(handled) < 6 and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.3)
    finally:
        sa.event.remove(pg.engine, "commit", on_commit)
        sa.event.remove(pg.engine, "before_cursor_execute", on_statement)
    assert sorted(handled) == [f"k{i}" for i in range(6)]
    # The first take reads the controls in a transaction, relaxed; each later one rides in
    # the acknowledgement before it, which waits, and a take alone relaxes itself.
    assert ("off", "transaction") in commits, commits
    assert all(setting == "off" for setting, kind in commits if kind == "take"), commits
    assert all(setting == "on" for setting, kind in commits if kind == "ack"), commits
    assert len([c for c in commits if c[1] == "ack"]) >= 6, commits  # the last with no take


@contextlib.contextmanager
def counting_commits(worker: Any, backend: Any) -> Iterator[list[int]]:
    """A list that grows by one per commit on the engine the worker's sessions use, and by
    one per statement that commits on its own (an autocommit connection's)."""
    engine = getattr(worker, "engine", None)
    engine = backend.engine if engine is None else engine.sync_engine
    commits: list[int] = []

    def on_commit(conn: Any) -> None:
        commits.append(1)

    def on_execute(conn: Any, *args: Any) -> None:
        if conn.get_execution_options().get("isolation_level") == "AUTOCOMMIT":
            commits.append(1)

    sa.event.listen(engine, "commit", on_commit)
    sa.event.listen(engine, "after_execute", on_execute)
    try:
        yield commits
    finally:
        sa.event.remove(engine, "commit", on_commit)
        sa.event.remove(engine, "after_execute", on_execute)


@pytest.mark.parametrize("form", ["one", "batch_size", "batch_handler"])
def test_a_lease_consumer_acknowledges_and_takes_the_next_in_one_transaction(
    backend, form, make_worker
):
    """While takes come back full, the last acknowledgement of a take also takes the next
    envelopes: n takes cost n + 1 transactions, not 2n + 1, and every message is handled once,
    acknowledged, and reported once."""
    total, size = 24, 4
    q: DelayedQueue[Any] = DelayedQueue(f"chain-{form}")
    with backend.Session() as s, s.begin():
        q.offer_batch(s, [(f"m{i:03d}", {"i": i}) for i in range(total)])
    delivered: list[str] = []
    hooks = RecordingHooks()
    options: dict[str, Any] = {"batch_size": size} if form == "batch_size" else {}
    worker = make_worker(
        backend,
        concurrency=1,
        poll_interval=30,
        listen=False,
        keep_statistics=False,
        hooks=hooks,
        **options,
    )
    if form == "batch_handler":
        worker.register_batch(q, lambda es: delivered.extend(e.key for e in es), batch_size=size)
    else:
        worker.register(q, lambda env: delivered.append(env.key), mode="lease")
    with counting_commits(worker, backend) as commits, running(worker):
        assert wait_for(lambda: pending(backend, q) == 0 and waiting(worker) == 1, 60, 0.02)
        done = len(commits)
    assert sorted(delivered) == [f"m{i:03d}" for i in range(total)]
    assert sorted(k for _, k, _ in hooks.processed_) == sorted(delivered)
    assert hooks.failed_ == [] and hooks.redelivered_ == []
    acks = total // size if form == "batch_handler" else total
    takes = total if form == "one" else total // size
    # One transaction per ack (the last of each take that came back full also took the
    # next), and the first take: acks + 1. Taking in transactions of their own costs
    # acks + takes (+ 1 for the take that finds the queue empty).
    assert done == acks + 1, (done, acks, takes)


def takes_in_acks(q: DelayedQueue[Any]) -> list[int]:
    """A list that grows by one per take made in a transaction that acknowledged first."""
    chained: list[int] = []
    ack, poll_batch = q.ack, q.poll_batch

    def acked(session: Session, envelope: Any) -> bool:
        session.info["test.acked"] = True
        return ack(session, envelope)

    def polled(session: Session, n: int, **kw: Any) -> Any:
        if session.info.get("test.acked"):
            chained.append(1)
        return poll_batch(session, n, **kw)

    fused = q.ack_and_poll

    def fused_take(session: Session, envelope: Any, n: int, lease: Any) -> Any:
        got = fused(session, envelope, n, lease)
        if got is not None:  # one statement acknowledged and took (PostgreSQL)
            chained.append(1)
        return got

    q.ack = acked  # type: ignore[method-assign]
    q.poll_batch = polled  # type: ignore[method-assign]
    q.ack_and_poll = fused_take  # type: ignore[method-assign]
    return chained


def unfused(q: DelayedQueue[Any]) -> None:
    """Chain takes to acknowledgements in a transaction, as on every backend but PostgreSQL
    (where one statement does both, see ``LeasedQueue.ack_and_poll``): for the tests of that
    transaction's faults."""
    q.ack_and_poll = lambda *args: None  # type: ignore[method-assign]


def test_on_postgresql_one_statement_acknowledges_and_takes_the_next(pg, monkeypatch):
    """Lease mode, batches of one: each acknowledgement and the take after it are one
    autocommit statement (one round trip and one commit per message, instead of ``BEGIN``,
    ack, take, ``COMMIT``)."""
    from sqla_delayedq import controls

    # The statement runs only while this process's view of the controls is fresh (a refresh
    # needs a transaction): keep it fresh, so a slow machine cannot turn one into the chain.
    monkeypatch.setattr(controls, "REFRESH", 600.0)
    monkeypatch.setattr(controls, "MIN_REFRESH", 600.0)  # a worker's keep_fresh too
    total = 10
    q: DelayedQueue[Any] = DelayedQueue("fused")
    with pg.Session() as s, s.begin():
        q.offer_batch(s, [(f"m{i}", {"i": i}) for i in range(total)])
    handled: list[str] = []
    worker = Worker(pg.Session, concurrency=1, poll_interval=30, listen=False)
    worker.register(q, lambda env: handled.append(env.key), mode="lease")
    with record_sql(pg.engine) as sql, running(worker):
        assert wait_for(lambda: len(handled) == total and pending(pg, q) == 0, 30)
    assert sorted(handled) == sorted(f"m{i}" for i in range(total))
    fused = [x for x in sql if x.lstrip().startswith("WITH acked AS")]
    alone = [x for x in sql if x.lstrip().startswith("DELETE FROM delayed_queue")]
    # The last acknowledgement follows a take that was not full (nothing more was due): alone.
    assert (len(fused), len(alone)) == (total - 1, 1)


def one_at_a_time(
    pg: Any, q: DelayedQueue[Any], picked: Callable[[str], bool], **options: Any
) -> list[bool]:
    """A lease-mode worker of one consumer while "a", "b" and "c" are offered one at a time,
    each acknowledged before the next: per statement that ``picked`` selects, whether its
    connection was in autocommit."""
    flags: list[bool] = []

    def seen(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if picked(statement.lstrip()):
            flags.append(bool(conn.connection.dbapi_connection.autocommit))

    handled: list[str] = []
    worker = Worker(pg.Session, concurrency=1, poll_interval=0.05, listen=False, **options)
    worker.register(q, lambda env: handled.append(env.key), mode="lease")
    sa.event.listen(pg.engine, "before_cursor_execute", seen)
    try:
        with running(worker):
            for key in ("a", "b", "c"):
                offer(pg, q, key)
                assert wait_for(lambda: pending(pg, q) == 0, 15)
    finally:
        sa.event.remove(pg.engine, "before_cursor_execute", seen)
    assert handled == ["a", "b", "c"]
    return flags


def test_on_postgresql_a_lease_take_is_one_statement_that_commits_on_its_own(pg, monkeypatch):
    """An idle lease-mode consumer woken for a message takes it in one autocommit statement:
    one round trip before its handler starts, where ``BEGIN``, the take and ``COMMIT`` were
    three."""
    from sqla_delayedq import controls

    monkeypatch.setattr(controls, "REFRESH", 600.0)  # a refresh needs a transaction's take
    monkeypatch.setattr(controls, "MIN_REFRESH", 600.0)  # a worker's keep_fresh too
    takes = one_at_a_time(
        pg,
        DelayedQueue("alone"),
        lambda sql: "SKIP LOCKED" in sql and not sql.startswith("WITH acked AS"),
    )
    # The first take reads the controls (in a transaction); every later one commits alone.
    assert takes[0] is False and len(takes) > 3 and all(takes[1:]), takes


@pytest.mark.parametrize("committed", [True, False])
def test_a_take_alone_that_failed_without_a_reply_loses_and_repeats_nothing(
    pg, make_worker, committed, monkeypatch, caplog
):
    """The autocommit take raises as a lost connection does: it ran and committed
    (``committed``) or it did not, and the worker cannot tell. What it may have taken is given
    back at once, uncounted (left alone, it stays leased under tokens nobody holds, then counts
    an attempt: dead, with one allowed), and taken again: every message handled once, none
    dead, none redelivered."""
    from sqla_delayedq import controls
    from sqla_delayedq._leases import FUSED

    monkeypatch.setattr(controls, "REFRESH", 600.0)  # keep the takes alone (see above)
    monkeypatch.setattr(controls, "MIN_REFRESH", 600.0)  # a worker's keep_fresh too
    real = PostgreSQLStrategy.claim
    armed: list[bool] = []
    fired: list[bool] = []

    def lost(self: Any, session: Session, *args: Any, **kw: Any) -> Any:
        if armed and not fired and session.info.get(FUSED):
            fired.append(True)
            if committed:
                real(self, session, *args, **kw)
            raise TransientError("injected: the connection was lost")
        return real(self, session, *args, **kw)

    monkeypatch.setattr(PostgreSQLStrategy, "claim", lost)
    retry = ExponentialBackoff(max_attempts=1, initial=timedelta(hours=1), jitter=0)
    q: DelayedQueue[Any] = DelayedQueue("alone-lost", lease=timedelta(minutes=5), retry=retry)
    handled: list[str] = []
    hooks = RecordingHooks()
    worker = make_worker(
        pg, concurrency=1, poll_interval=0.05, listen=False, keep_statistics=False, hooks=hooks
    )
    worker.register(q, lambda env: handled.append(env.key), mode="lease")
    keys = ["m0", "m1", "m2"]
    with caplog.at_level("WARNING", logger="sqla_delayedq"), running(worker):
        assert wait_for(lambda: waiting(worker) == 1, 15)  # idle: its takes commit alone
        armed.append(True)
        with pg.Session() as s, s.begin():
            q.offer_batch(s, [(k, {}) for k in keys])
        assert wait_for(lambda: pending(pg, q) == 0, 30)
    assert fired
    assert sorted(handled) == keys  # each once: nothing waited for its lease to run out
    assert sorted(k for _, k, _ in hooks.processed_) == keys
    assert hooks.failed_ == [] and hooks.redelivered_ == [] and hooks.buried_ == []
    assert len(hooks.db_errors) == 1
    assert ("committed, though it raised" in caplog.text) is committed
    with pg.Session() as s:
        assert q.counts(s).dead == 0


def test_a_take_alone_whose_session_fails_after_it_returned_delivers_what_it_took(
    pg, make_worker, monkeypatch
):
    """The autocommit take returned (its statement committed), then its session failed (the
    connection lost before the session's own commit, a no-op there, could run): its messages
    are handled at once. Dropped, they stayed leased under tokens nobody held until the lease
    ran out, which counted an attempt: dead, with one allowed, though no handler had run."""
    from sqla_delayedq import controls

    monkeypatch.setattr(controls, "REFRESH", 600.0)  # keep the takes alone
    monkeypatch.setattr(controls, "MIN_REFRESH", 600.0)  # a worker's keep_fresh too
    real = DelayedQueue.poll_alone
    fired: list[bool] = []

    def then_lost(self: Any, session: Session, n: int, lease: Any) -> Any:
        polled = real(self, session, n, lease)
        if polled is not None and polled.envelopes and not fired:
            fired.append(True)

            def lost() -> None:
                raise TransientError("injected: the connection was lost")

            session.commit = lost  # type: ignore[method-assign]  # its AloneSession's, once
        return polled

    monkeypatch.setattr(DelayedQueue, "poll_alone", then_lost)
    retry = ExponentialBackoff(max_attempts=1, initial=timedelta(hours=1), jitter=0)
    q: DelayedQueue[Any] = DelayedQueue("alone-then-lost", lease=timedelta(minutes=5), retry=retry)
    handled: list[str] = []
    hooks = RecordingHooks()
    worker = make_worker(
        pg, concurrency=1, poll_interval=0.05, listen=False, keep_statistics=False, hooks=hooks
    )
    worker.register(q, lambda env: handled.append(env.key), mode="lease")
    keys = ["m0", "m1", "m2"]
    with running(worker):
        assert wait_for(lambda: waiting(worker) == 1, 15)  # idle: its takes commit alone
        with pg.Session() as s, s.begin():
            q.offer_batch(s, [(k, {}) for k in keys])
        assert wait_for(lambda: pending(pg, q) == 0, 30)
    assert fired
    assert sorted(handled) == keys
    assert hooks.redelivered_ == [] and hooks.buried_ == [] and len(hooks.db_errors) == 1
    with pg.Session() as s:
        assert q.counts(s).dead == 0


def test_on_postgresql_a_statement_alone_that_cannot_connect_loses_no_acknowledgement(
    pg, make_worker, monkeypatch
):
    """The connection of an acknowledgement alone (its own autocommit connection) cannot be
    made (the database restarting): the acknowledgement is made again in a transaction, as
    after any failure of that statement, and the message is handled once, none dead."""
    from sqla_delayedq import controls
    from sqla_delayedq._consumer import AloneSession

    monkeypatch.setattr(controls, "REFRESH", 600.0)  # keep the statements alone
    monkeypatch.setattr(controls, "MIN_REFRESH", 600.0)  # a worker's keep_fresh too
    real = AloneSession.connection
    armed: list[bool] = []

    def refused(self: AloneSession) -> Any:
        if armed and armed.pop():
            raise sa.exc.OperationalError(
                "connect", {}, Exception("connection refused"), connection_invalidated=True
            )
        return real(self)

    monkeypatch.setattr(AloneSession, "connection", refused)
    retry = ExponentialBackoff(max_attempts=1, initial=timedelta(hours=1), jitter=0)
    q: DelayedQueue[Any] = DelayedQueue("alone-refused", retry=retry)
    handled: list[str] = []

    def handle(env: Envelope[Any]) -> None:
        handled.append(env.key)
        armed.append(True)  # the next connection made alone is this acknowledgement's

    worker = make_worker(pg, concurrency=1, poll_interval=0.05, listen=False)
    worker.register(q, handle, mode="lease")
    with running(worker):
        assert wait_for(lambda: waiting(worker) == 1, 15)
        with pg.Session() as s, s.begin():
            q.gate(s)  # this process's picture of the controls: fresh, so statements run alone
            q.offer(s, "m", {})
        assert wait_for(lambda: pending(pg, q) == 0, 15)
    assert handled == ["m"] and not armed
    with pg.Session() as s:
        assert q.counts(s).dead == 0


def test_on_postgresql_an_acknowledgement_alone_is_one_statement(pg):
    """A lease-mode acknowledgement that takes nothing after it (the take before it was not
    full) is one autocommit statement: one round trip and one durable commit, where ``BEGIN``,
    the ack and ``COMMIT`` were three."""
    acks = one_at_a_time(
        pg,
        DelayedQueue("ack-alone"),
        lambda sql: sql.startswith("DELETE FROM delayed_queue WHERE delayed_queue.id ="),
        batch_size=5,
    )
    assert acks == [True, True, True]


@pytest.mark.parametrize("mode", ["lease", "transactional", "batch"])
def test_a_drain_runs_its_statements_as_cached_without_rewriting_them(backend, make_worker, mode):
    """Every statement of a drain (takes, fused acknowledgements, reads between them) runs as
    SQLAlchemy cached it: none has a ``LIMIT`` written into its text at each execution (the
    post-compile step of ``literal_execute``, a few percent of a message's client time)."""
    q: DelayedQueue[Any] = DelayedQueue(f"cached-{mode}")
    with backend.Session() as s, s.begin():
        for i in range(30):
            q.offer(s, f"k{i}", {})
    handled: list[str] = []
    rewritten: list[str] = []
    worker = make_worker(backend, concurrency=2, poll_interval=0.05, listen=False)
    engine = worker.engine.sync_engine if isinstance(worker, AsyncRunner) else backend.engine

    def seen(conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: Any) -> None:
        if context.compiled is not None and context.compiled.literal_execute_params:
            rewritten.append(" ".join(statement.split())[:120])

    if mode == "batch":
        worker.register_batch(q, lambda envs: handled.extend(e.key for e in envs), batch_size=7)
    elif mode == "transactional":
        worker.register(q, lambda env, s: handled.append(env.key), mode=mode)
    else:
        worker.register(q, lambda env: handled.append(env.key), mode=mode)
    sa.event.listen(engine, "before_cursor_execute", seen)
    try:
        with running(worker):
            assert wait_for(lambda: len(handled) == 30, 30)
    finally:
        sa.event.remove(engine, "before_cursor_execute", seen)
    assert sorted(handled) == sorted(f"k{i}" for i in range(30))
    assert rewritten == []


@pytest.mark.parametrize("committed", [True, False])
def test_an_acknowledgement_alone_that_failed_without_a_reply_is_made_again(
    pg, make_worker, committed, monkeypatch, caplog
):
    """The autocommit acknowledgement raises as a lost connection does, after it committed
    (``committed``) or before: it is made again in a transaction, as after a failed commit.
    Every message handled once and gone, none redelivered; a second try refused because the
    first committed says so in the log."""
    real = DelayedQueue.ack_alone
    fired: list[bool] = []

    def lost(self: Any, session: Session, envelope: Any) -> Any:
        if not fired:
            fired.append(True)
            if committed:
                real(self, session, envelope)
            raise TransientError("injected: the connection was lost")
        return real(self, session, envelope)

    monkeypatch.setattr(DelayedQueue, "ack_alone", lost)
    q: DelayedQueue[Any] = DelayedQueue("ack-alone-lost")
    handled: list[str] = []
    hooks = RecordingHooks()
    worker = make_worker(
        pg, concurrency=1, poll_interval=0.05, listen=False, keep_statistics=False, hooks=hooks
    )
    worker.register(q, lambda env: handled.append(env.key), mode="lease")
    with caplog.at_level("WARNING", logger="sqla_delayedq"), running(worker):
        for key in ("a", "b"):
            offer(pg, q, key)
            assert wait_for(lambda: pending(pg, q) == 0, 15)
    assert fired and handled == ["a", "b"]
    assert hooks.redelivered_ == [] and hooks.failed_ == [] and len(hooks.db_errors) == 1
    # Refused only when the first try committed: then the log says it may be acknowledged.
    reported = sorted(k for _, k, _ in hooks.processed_)
    assert reported == (["b"] if committed else ["a", "b"])
    assert ("may be acknowledged" in caplog.text) is committed


def test_on_postgresql_a_grouped_queue_acknowledges_and_takes_in_one_statement(pg, monkeypatch):
    """A queue with groups fuses too: 4 consumers, 6 groups of 6 messages. The statement's take
    reads a snapshot in which the acknowledged message is still pending under its lease, so
    its group's next message waits for the next take: each group in order, never two of one
    group at once, every message once."""
    from sqla_delayedq import controls

    monkeypatch.setattr(controls, "REFRESH", 600.0)  # as above: no refresh turns one into the chain
    monkeypatch.setattr(controls, "MIN_REFRESH", 600.0)  # a worker's keep_fresh too
    q: DelayedQueue[Any] = DelayedQueue("fused-groups", groups=True)
    now = datetime.now(UTC)
    with pg.Session() as s, s.begin():
        q.offer_batch(
            s,
            [
                (f"g{g}/{i}", {"i": i}, now - timedelta(seconds=60 - i), f"g{g}")
                for i in range(6)
                for g in range(6)
            ],
        )
    lock = threading.Lock()
    running_groups: Counter[str] = Counter()
    overlaps: list[str] = []
    handled: list[tuple[str, int]] = []

    def handle(env: Any) -> None:
        with lock:
            running_groups[env.group] += 1
            if running_groups[env.group] > 1:
                overlaps.append(env.key)
        time.sleep(0.005)
        with lock:
            running_groups[env.group] -= 1
            handled.append((env.group, env.payload["i"]))

    worker = Worker(pg.Session, concurrency=4, poll_interval=0.05, listen=False)
    worker.register(q, handle, mode="lease")
    with record_sql(pg.engine) as sql, running(worker):
        assert wait_for(lambda: len(handled) == 36 and pending(pg, q) == 0, 60)
    assert overlaps == []
    for g in range(6):
        assert [i for group, i in handled if group == f"g{g}"] == list(range(6))
    fused = [x for x in sql if x.lstrip().startswith("WITH acked AS")]
    assert fused and all("earlier" in x for x in fused), len(fused)


@pytest.mark.parametrize("kind", ["lease", "lease with groups", "transactional"])
def test_on_postgresql_a_worker_s_takes_are_planned_once(pg, monkeypatch, kind):
    """A worker's take statements stay prepared on its connections (psycopg forgets them all at
    any rollback) and run the plan PostgreSQL keeps for all values, not one planned again at
    every take (see ``test_a_prepared_take_keeps_one_plan_for_all_its_values``): each take
    statement a connection ran more than ten times ran that plan."""
    from sqla_delayedq import controls, create_engine

    monkeypatch.setattr(controls, "REFRESH", 600.0)  # the fused statement, as above
    monkeypatch.setattr(controls, "MIN_REFRESH", 600.0)  # a worker's keep_fresh too
    engine = create_engine(pg.engine.url)
    raw: list[Any] = []
    sa.event.listen(engine, "connect", lambda dbapi, record: raw.append(dbapi))
    q: DelayedQueue[Any] = DelayedQueue("planned", groups=kind == "lease with groups")
    with sessionmaker(engine).begin() as s:  # a backlog: the worker takes a few dozen of it
        group = "g" if q.grouping else None
        now = datetime.now(UTC)
        q.offer_batch(
            s,
            [
                (f"m{i}", {}, now - timedelta(milliseconds=20 - i // 200), group and f"g{i % 200}")
                for i in range(4000)
            ],
        )
    with engine.connect() as conn:  # statistics of the backlog, as autovacuum's would be
        conn.exec_driver_sql("ANALYZE delayed_queue")
    handled: list[str] = []
    worker = Worker(sessionmaker(engine), concurrency=1, poll_interval=0.05, listen=False)
    if kind == "transactional":
        worker.register(q, lambda env, s: handled.append(env.key), mode="transactional")
    else:
        worker.register(q, lambda env: handled.append(env.key), mode="lease")
    try:
        with running(worker):
            assert wait_for(lambda: len(handled) >= 50, 60)
        plans: list[tuple[str, int, int]] = []
        for conn in raw:
            if not conn.closed:
                plans += conn.execute(
                    "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements"
                ).fetchall()
    finally:
        engine.dispose()
    takes = [p for p in plans if "SKIP LOCKED" in p[0] and p[1] + p[2] > 10]
    assert takes, [p[1:] for p in plans]
    if kind == "lease":
        assert any(p[0].lstrip().startswith("WITH acked AS") for p in takes), plans
    if kind == "lease with groups":
        assert any("earlier" in p[0] for p in takes), plans
    assert all(generic > 0 for _, generic, _ in takes), [p[1:] for p in takes]


def test_elsewhere_a_chained_acknowledgement_never_switches_to_autocommit(backend, make_worker):
    """Only PostgreSQL has the one statement: elsewhere the connection is never switched to
    autocommit for it (PyMySQL pays a round trip to turn it on and one to turn it off)."""
    q: DelayedQueue[Any] = DelayedQueue("fused-where")
    with backend.Session() as s, s.begin():
        q.offer_batch(s, [(f"m{i}", {}) for i in range(5)])
    switched: list[Any] = []

    def spy(conn: Any, options: Any) -> None:
        if options.get("isolation_level") == "AUTOCOMMIT":
            switched.append(conn)

    sa.event.listen(sa.engine.Engine, "set_connection_execution_options", spy)
    try:
        handled: list[str] = []
        worker = make_worker(backend, concurrency=1, poll_interval=30, listen=False)
        worker.register(q, lambda env: handled.append(env.key), mode="lease")
        with running(worker):
            assert wait_for(lambda: len(handled) == 5 and pending(backend, q) == 0, 30)
    finally:
        sa.event.remove(sa.engine.Engine, "set_connection_execution_options", spy)
    assert bool(switched) == (backend.name == "postgresql"), switched


@pytest.mark.parametrize("committed", [True, False])
def test_a_fused_statement_that_failed_without_a_reply_loses_and_repeats_nothing(
    pg, make_worker, committed, monkeypatch
):
    """The acknowledge-and-take statement raises as a lost connection does: it ran and
    committed (``committed``) or it did not, and the worker cannot tell. What it may have taken
    is given back at once, uncounted (left alone, it stayed leased under tokens nobody held,
    then counted an attempt: dead, with one allowed), and the acknowledgement is made on its
    own when it did not commit: every message handled once, none dead, every success
    reported."""
    real = PostgreSQLStrategy.ack_and_claim
    fired: list[bool] = []

    def lost(self: Any, *args: Any, **kw: Any) -> Any:
        if not fired:
            fired.append(True)
            if committed:
                real(self, *args, **kw)
            raise TransientError("injected: the connection was lost")
        return real(self, *args, **kw)

    monkeypatch.setattr(PostgreSQLStrategy, "ack_and_claim", lost)
    retry = ExponentialBackoff(max_attempts=1, initial=timedelta(hours=1), jitter=0)
    q: DelayedQueue[Any] = DelayedQueue("fused-lost", lease=timedelta(minutes=5), retry=retry)
    keys = [f"m{i}" for i in range(4)]
    with pg.Session() as s, s.begin():
        q.offer_batch(s, [(k, {}) for k in keys])
    handled: list[str] = []
    hooks = RecordingHooks()
    worker = make_worker(
        pg, concurrency=1, poll_interval=0.05, listen=False, keep_statistics=False, hooks=hooks
    )
    worker.register(q, lambda env: handled.append(env.key), mode="lease")
    with running(worker):
        assert wait_for(lambda: pending(pg, q) == 0, 30)
    assert fired
    assert sorted(handled) == keys  # each once: nothing waited for its lease to run out
    assert sorted(k for _, k, _ in hooks.processed_) == keys
    assert hooks.failed_ == [] and hooks.redelivered_ == [] and hooks.buried_ == []
    assert len(hooks.db_errors) == 1
    with pg.Session() as s:
        assert q.counts(s).dead == 0


@pytest.mark.parametrize("limited", [False, True])
def test_a_limited_queue_s_takes_never_ride_in_acknowledgements(backend, limited, make_worker):
    """Under a global in-flight limit an acknowledgement that took again at once would keep its
    slot from every other consumer (of every process): a limited queue's consumer commits its
    acknowledgement, then takes in a transaction of its own, where all compete for the slot. A
    plain queue's consumer chains them."""
    total = 10
    q: DelayedQueue[Any] = DelayedQueue(f"chain-limited-{limited}")
    with backend.Session() as s, s.begin():
        q.offer_batch(s, [(f"m{i}", {"i": i}) for i in range(total)])
        if limited:
            q.set_limits(s, max_in_flight=5)
    chained = takes_in_acks(q)
    handled: list[str] = []
    worker = make_worker(backend, concurrency=1, poll_interval=30, listen=False)
    worker.register(q, lambda env: handled.append(env.key), mode="lease")
    with running(worker):
        assert wait_for(lambda: len(handled) == total and pending(backend, q) == 0, 60)
    assert sorted(handled) == sorted(f"m{i}" for i in range(total))
    assert len(chained) == (0 if limited else total - 1)


@pytest.mark.parametrize("error", ["transient", "bug"])
def test_a_take_that_fails_after_an_ack_loses_neither_the_ack_nor_a_message(
    backend, error, make_worker
):
    """The take chained to an acknowledgement fails once (a deadlock; a bug): its transaction
    rolls back with the acknowledgement in it, the acknowledgement is made again on its own,
    and the consumer goes on taking: every message handled once, acknowledged, reported once,
    and nothing redelivered."""
    total = 6
    q: DelayedQueue[Any] = DelayedQueue(f"chain-fails-{error}")
    with backend.Session() as s, s.begin():
        q.offer_batch(s, [(f"m{i}", {"i": i}) for i in range(total)])
    real = q.poll_batch
    calls: list[int] = []

    def flaky(session: Session, n: int, **kw: Any) -> Any:
        calls.append(n)
        if len(calls) == 2:  # the first take chained to an ack, after the ack's statement
            if error == "transient":
                raise TransientError("injected: deadlock detected")
            raise RuntimeError("injected: a bug in the take")
        return real(session, n, **kw)

    q.poll_batch = flaky  # type: ignore[method-assign]
    unfused(q)
    delivered: list[str] = []
    hooks = RecordingHooks()
    worker = make_worker(
        backend, concurrency=1, poll_interval=30, listen=False, keep_statistics=False, hooks=hooks
    )
    worker.register(q, lambda env: delivered.append(env.key), mode="lease")
    with running(worker):
        assert wait_for(lambda: pending(backend, q) == 0 and waiting(worker) == 1, 60, 0.02)
    assert getattr(worker, "worker", worker).failure is None
    assert len(calls) >= 3  # the chained take failed, and taking went on
    assert sorted(delivered) == [f"m{i}" for i in range(total)]
    assert sorted(k for _, k, _ in hooks.processed_) == sorted(delivered)
    assert hooks.failed_ == [] and hooks.redelivered_ == []
    assert len(hooks.db_errors) == (1 if error == "transient" else 0)


def test_a_backlog_in_the_first_queue_does_not_hold_back_the_queues_after_it(backend, make_worker):
    """A consumer whose first queue always had more due took from it again and again (chaining
    its takes to its acknowledgements) and never looked at the worker's other queues until the
    first one drained: a due message of the second queue waited behind the whole backlog."""
    bulk: DelayedQueue[Any] = DelayedQueue("backlog-first")
    behind: DelayedQueue[Any] = DelayedQueue("registered-second")
    handled: list[str] = []
    with backend.Session.begin() as s:
        bulk.offer_batch(s, [(f"b{i:04d}", {}) for i in range(300)])
        behind.offer(s, "waiting", {})

    worker = make_worker(backend, concurrency=1, poll_interval=5.0, listen=False)
    worker.register(bulk, lambda env: handled.append(env.key))
    worker.register(behind, lambda env: handled.append(env.key))
    with running(worker):
        assert wait_for(lambda: "waiting" in handled, 30)
    assert handled.index("waiting") <= 50, handled.index("waiting")  # not after all 300


# -- clock skew -------------------------------------------------------------------------------


def test_a_worker_whose_clock_is_fast_by_half_a_lease_says_messages_may_run_twice(
    server_backend, make_worker, caplog, monkeypatch
):
    """The queue decides by the host's clock: one 10 minutes ahead of the database server's
    sees other workers' leases as run out. The worker says so at start (and runs on)."""
    fast = lambda: utcnow() + timedelta(minutes=10)  # noqa: E731
    monkeypatch.setattr(_skew, "system_clock", fast)  # this host's system clock is fast
    q: DelayedQueue[Any] = DelayedQueue("skewed", lease=timedelta(minutes=5), clock=fast)
    worker = make_worker(server_backend, concurrency=1, poll_interval=0.05, listen=False)
    worker.register(q, lambda env: None)
    with caplog.at_level("WARNING", logger="sqla_delayedq"), running(worker):
        assert wait_for(lambda: "run twice" in caplog.text, 30), caplog.text
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1, errors
    assert "600.0 s ahead of the database server's" in errors[0]
    assert "skewed" in errors[0] and "NTP" in errors[0]


def test_a_worker_in_step_with_the_database_and_a_test_clock_log_nothing(
    server_backend, make_worker, caplog
):
    """A host within a second of the database logs nothing above DEBUG; a queue on an injected
    clock (a test's, far from the database's on purpose) is not checked."""
    q: DelayedQueue[Any] = DelayedQueue("in-step", lease=timedelta(seconds=1))
    manual: DelayedQueue[Any] = DelayedQueue("manual", clock=ManualClock())
    worker = make_worker(server_backend, concurrency=1, poll_interval=0.05, listen=False)
    worker.register(q, lambda env: None).register(manual, lambda env: None)
    with caplog.at_level("DEBUG", logger="sqla_delayedq.worker"), running(worker):
        assert wait_for(lambda: "the database server's" in caplog.text, 30), caplog.text
    skew = [r.getMessage() for r in caplog.records if "the database server's" in r.getMessage()]
    assert len(skew) == 1 and "manual" not in skew[0], skew
    assert [r.levelname for r in caplog.records if r.levelno >= logging.WARNING] == []


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
@pytest.mark.parametrize("kind", ["thread", "asyncio"])
def test_run_gives_the_process_back_its_own_signal_handlers(backend, kind):
    """``run()`` handles SIGTERM and SIGINT while it runs, then restores the handlers the
    process had. The asyncio worker restored the defaults instead, so the SIGTERM a supervisor
    sends after a Ctrl-C killed a worker process that had already stopped cleanly (status -15,
    and ``delayedq worker -p N`` exited 1); the thread worker left its own handler, which
    swallowed every later SIGTERM and SIGINT of the process."""
    import signal

    from sqlalchemy.ext.asyncio import async_sessionmaker

    from sqla_delayedq.aio import AsyncWorker, create_async_engine
    from tests.fix_db import ASYNC_DRIVERS

    def mine(signum: int, frame: Any) -> None:
        pass

    before = {sig: signal.signal(sig, mine) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        if kind == "thread":
            worker = Worker(backend.Session, poll_interval=0.05, listen=False)
            worker.register(DelayedQueue("signals"), lambda env: None)
            threading.Timer(0.3, worker.request_stop).start()
            assert worker.run() is True
        else:
            url = backend.url.set(drivername=ASYNC_DRIVERS[backend.name])
            engine = create_async_engine(url)
            aworker = AsyncWorker(async_sessionmaker(engine), poll_interval=0.05, listen=False)

            async def handle(env: Any) -> None:
                pass

            aworker.register(DelayedQueue("signals"), handle)

            async def main() -> bool:
                asyncio.get_running_loop().call_later(0.3, aworker.request_stop)
                try:
                    return await aworker.run()
                finally:
                    await engine.dispose()

            assert asyncio.run(main()) is True
        assert signal.getsignal(signal.SIGTERM) is mine
        assert signal.getsignal(signal.SIGINT) is mine
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_a_fused_statement_that_failed_after_its_take_committed_ends_an_offer_s_hold(
    pg, make_worker, monkeypatch
):
    """An offer updated a message while its handler ran (held for that delivery until the
    handler's acknowledgement ends the hold). The acknowledgement rode in the statement that
    also takes the next message, which committed and then raised as a lost connection does.
    What it took was given back and the acknowledgement counted as made, so nothing ended the
    hold: the new version waited for the old lease's end (five minutes here) to be delivered."""
    import threading

    from sqla_delayedq import controls

    monkeypatch.setattr(controls, "REFRESH", 600.0)  # no controls read: the fused path
    monkeypatch.setattr(controls, "MIN_REFRESH", 600.0)
    real = PostgreSQLStrategy.ack_and_claim
    updated = threading.Event()
    fired: list[Any] = []

    def committed_then_lost(self: Any, session: Session, *args: Any, **kw: Any) -> Any:
        if updated.is_set() and not fired:
            fired.append(real(self, session, *args, **kw))
            raise TransientError("injected: the connection was lost after the commit")
        return real(self, session, *args, **kw)

    monkeypatch.setattr(PostgreSQLStrategy, "ack_and_claim", committed_then_lost)
    q: DelayedQueue[Any] = DelayedQueue("fused-hold", lease=timedelta(minutes=5))
    handled: list[tuple[str, int]] = []

    def handle(env: Envelope[Any]) -> None:
        if env.key == "a" and env.payload["v"] == 1:
            with pg.Session() as s, s.begin():  # another process updates it meanwhile
                q.offer(s, "a", {"v": 2})
            updated.set()
        handled.append((env.key, env.payload["v"]))

    worker = make_worker(pg, concurrency=1, poll_interval=0.05, listen=False)
    worker.register(q, handle, mode="lease")
    with pg.Session() as s, s.begin():
        q.offer(s, "a", {"v": 1}, at=datetime.now(UTC) - timedelta(seconds=2))
        q.offer(s, "b", {"v": 1}, at=datetime.now(UTC) - timedelta(seconds=1))
    with running(worker):
        assert wait_for(lambda: ("a", 2) in handled and ("b", 1) in handled, 20), handled
    [(acked, claims)] = fired
    assert acked == 0 and len(claims.claimed) == 1  # the hold refused it; it took "b"
    assert sorted(handled) == [("a", 1), ("a", 2), ("b", 1)]
    assert pending(pg, q) == 0


def test_a_heartbeat_whose_connection_is_lost_while_it_waits_keeps_the_worker_running(mariadb):
    """MariaDB: the heartbeat bounds its wait for a row lock with a session variable it puts
    back after the extension. On a connection the server dropped meanwhile, putting it back
    failed too, and its error (``PendingRollbackError``, not a transient one) replaced the lost
    connection's: the worker stopped, and the next message was never handled (found in
    review). The heartbeat now reports the extension's error and looks again."""
    backend = mariadb
    q: DelayedQueue[Any] = DelayedQueue("hb-lost", lease=timedelta(seconds=2))
    with backend.Session.begin() as s:
        q.offer(s, "long", {})
        q.offer(s, "next", {}, q.now() + timedelta(seconds=1))
    admin = sa.create_engine(backend.url, isolation_level="AUTOCOMMIT")
    database = backend.url.database
    handled: list[str] = []
    killed: list[bool] = []

    def kill_the_heartbeat() -> None:
        deadline = time.monotonic() + 5
        while not killed and time.monotonic() < deadline:
            with admin.connect() as c:
                waiting = c.execute(
                    sa.text(
                        "SELECT id FROM information_schema.processlist WHERE db = :d"
                        " AND info LIKE 'UPDATE delayed_queue SET scheduled_at%'"
                    ),
                    {"d": database},
                ).scalars()
                for pid in waiting:
                    c.execute(sa.text(f"KILL {int(pid)}"))
                    killed.append(True)
            time.sleep(0.05)

    def handler(envelope: Any) -> None:
        if envelope.key == "long":
            with backend.Session.begin() as s:  # holds the row: the heartbeat waits for it
                s.execute(
                    sa.text("SELECT id FROM delayed_queue WHERE `key` = 'long' FOR UPDATE")
                ).all()
                kill_the_heartbeat()
        handled.append(envelope.key)

    worker = Worker(backend.Session, concurrency=1, poll_interval=0.2, listen=False)
    worker.register(q, handler)
    try:
        with running(worker):
            deadline = time.monotonic() + 15
            while "next" not in handled and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not worker.stopping
    finally:
        admin.dispose()
    assert killed and handled == ["long", "next"]
