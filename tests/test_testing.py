"""The testing helpers users get (``sqla_delayedq.testing`` and its pytest plugin).

Each helper on every backend: a queue database on the user's own engine, assertions on what a
transaction offered, ``drain`` through the worker's own ``process_due`` (chains, delays and
retries with a moved clock, the bound), ``inline`` on commit and never on rollback, and
``drain_async`` on the asyncio worker. The plugin's fixtures give an in-memory SQLite queue.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from datetime import UTC, datetime, timedelta
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, cast

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import DeclarativeBase

from sqla_delayedq import (
    DelayedQueue,
    ExponentialBackoff,
    InvalidArgument,
    MessageFilter,
    QueueControls,
    QueueMessageMixin,
    State,
)
from sqla_delayedq._time import LONGEST
from sqla_delayedq.aio import AsyncWorker
from sqla_delayedq.models import controls_table
from sqla_delayedq.testing import (
    DEFAULT_START,
    DrainLimitExceeded,
    HandlerFailed,
    ManualClock,
    QueueDatabase,
    assert_not_offered,
    assert_offered,
    drain,
    drain_async,
    inline,
    queue_database,
)

NO_JITTER = ExponentialBackoff(max_attempts=3, initial=timedelta(seconds=10), jitter=0)


# -- the plugin's fixtures, in memory ------------------------------------------------------------


def test_plugin_fixtures_give_an_in_memory_queue_on_the_manual_clock(
    delayedq_db: QueueDatabase, delayedq_queue: DelayedQueue[Any], delayedq_clock: ManualClock
) -> None:
    assert delayedq_db.engine.url.database in (None, "", ":memory:")
    assert delayedq_queue.now() == delayedq_clock()
    seen: list[Any] = []
    worker = delayedq_db.worker().register(delayedq_queue, lambda env: seen.append(env.payload))
    with delayedq_db.sessions.begin() as s:
        delayedq_queue.offer(s, "later", {"n": 2}, at=delayedq_clock() + timedelta(hours=1))
        delayedq_queue.offer(s, "now", {"n": 1})
    assert drain(worker).handled == 1
    assert seen == [{"n": 1}]
    assert drain(worker, clock=delayedq_clock).handled == 1
    assert seen == [{"n": 1}, {"n": 2}]


def test_the_plugin_database_is_private_to_each_test(delayedq_queue, delayedq_db) -> None:
    assert_not_offered(delayedq_queue, delayedq_db.engine)


def test_the_clock_moves_only_forward_and_lends_itself_to_existing_queues() -> None:
    clock = ManualClock()
    start = clock()
    assert clock.advance(5) == start + timedelta(seconds=5)
    with pytest.raises(ValueError, match="forward"):
        clock.set(start)
    app_queue: DelayedQueue[Any] = DelayedQueue("app")
    with clock.use(app_queue):
        assert app_queue.now() == clock()
    assert app_queue.now() != clock()


@pytest.mark.parametrize(
    "delta",
    [
        timedelta.max,
        LONGEST + timedelta(microseconds=1),
        1e20,
        pytest.param(10**400, id="an-int-too-large-for-a-float"),
        float("inf"),
        float("nan"),
        "5",
    ],
)
def test_the_clock_refuses_a_step_that_is_no_duration_or_too_long(delta: Any) -> None:
    """A clear InvalidArgument, not a raw OverflowError (or ValueError, TypeError), and the
    clock stays where it was."""
    clock = ManualClock()
    start = clock()
    with pytest.raises(InvalidArgument, match="delta must be"):
        clock.advance(delta)
    assert clock() == start


def test_the_clock_refuses_a_step_past_the_last_time_a_datetime_holds() -> None:
    clock = ManualClock()
    assert clock.advance(LONGEST) == DEFAULT_START + LONGEST  # about 1,000 years: fine
    clock.set(datetime(9500, 1, 1, tzinfo=UTC))
    with pytest.raises(InvalidArgument, match="passes the last time a datetime holds"):
        clock.advance(LONGEST)
    assert clock() == datetime(9500, 1, 1, tzinfo=UTC)
    with pytest.raises(InvalidArgument, match="forward"):
        clock.advance(-1e20)
    with pytest.raises(InvalidArgument, match="forward"):
        clock.advance(-(10**400))


def test_the_plugin_loads_by_entry_point_in_a_users_project(tmp_path: Path) -> None:
    """A user's suite gets the fixtures with no conftest and no import: pytest loads the plugin."""
    (ep,) = [e for e in entry_points(group="pytest11") if e.name == "sqla_delayedq"]
    assert ep.value == "sqla_delayedq.pytest_plugin"
    (tmp_path / "test_user.py").write_text(
        textwrap.dedent(
            """
            from datetime import timedelta

            from sqla_delayedq.testing import assert_offered, drain


            def test_reminder(delayedq_db, delayedq_queue, delayedq_clock):
                seen = []
                worker = delayedq_db.worker().register(delayedq_queue, seen.append)
                with delayedq_db.sessions.begin() as s:
                    delayedq_queue.offer(s, "r", {}, at=delayedq_clock() + timedelta(days=1))
                assert_offered(delayedq_queue, delayedq_db.engine, key="r")
                assert drain(worker, clock=delayedq_clock).handled == 1
                assert [e.key for e in seen] == ["r"]
            """
        )
    )
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_user.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed" in run.stdout


def test_importing_the_package_loads_neither_the_helpers_nor_pytest_nor_pydantic() -> None:
    code = (
        "import sys, sqla_delayedq; "
        "print(sorted(m for m in ('pytest', 'pydantic', 'sqla_delayedq.testing', "
        "'sqla_delayedq.pytest_plugin') if m in sys.modules))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.stdout.strip() == "[]", run.stderr


# -- on each backend, on the user's own engine ---------------------------------------------------


@pytest.fixture
def db(backend) -> Any:
    with queue_database(backend.engine) as database:
        yield database


def test_queue_database_on_your_engine_cleans_only_its_own_queues(backend) -> None:
    other: DelayedQueue[Any] = DelayedQueue("not-mine")
    with backend.Session.begin() as s:
        other.offer(s, "stays", {})
    with queue_database(backend.engine) as database:
        q = database.queue("mine")
        with database.sessions.begin() as s:
            q.offer(s, "goes", {})
    with backend.Session() as s:
        assert other.contains(s, "stays")
        assert not q.contains(s, "goes")


class _AppBase(DeclarativeBase):
    pass


class AppJob(QueueMessageMixin, _AppBase):
    """A project's own message table, as docs/testing.md's ``models=`` describes."""

    __tablename__ = "tt_app_jobs"


def test_queue_database_builds_its_queues_on_your_model_and_cleans_their_controls(
    backend,
) -> None:
    """``models=(YourMessage,)``: its queues went to ``delayed_queue`` instead (missing there,
    or another table's). A pause or limit a test set stayed on its queue for the next test
    (found in review)."""
    made = not sa.inspect(backend.engine).has_table(controls_table.name)
    if made:
        controls_table.create(backend.engine)
    try:
        on_app_jobs(backend)
    finally:
        if made:
            controls_table.drop(backend.engine)
    assert not sa.inspect(backend.engine).has_table("tt_app_jobs")


def on_app_jobs(backend: Any) -> None:
    with queue_database(backend.engine, models=(AppJob,)) as database:
        q = database.queue("test")
        assert q.table is AppJob.__table__
        with database.sessions.begin() as s:
            q.offer(s, "k", {})
            q.set_limits(s, rate=(1, timedelta(hours=1)))
        assert_offered(q, database.engine, key="k")
    with queue_database(backend.engine, models=(AppJob,)) as database, database.sessions() as s:
        assert database.queue("test").controls(s) == QueueControls()


def test_assert_offered_sees_the_callers_transaction_and_what_it_committed(db) -> None:
    q = db.queue("emails")
    with db.sessions.begin() as s:
        q.offer(s, "welcome/1", {"user": 1}, at=db.clock() + timedelta(minutes=5))
        info = assert_offered(q, s, key="welcome/1", payload={"user": 1})
        assert info.state is State.SCHEDULED
        assert_offered(q, s, payload={"user": 1}, at=db.clock() + timedelta(minutes=5))
    assert_offered(q, db.engine, key="welcome/1")
    assert_offered(q, db.sessions, payload={"user": 1})
    assert_not_offered(q, db.engine, key="welcome/2")
    assert_not_offered(q, db.engine, payload={"user": 2})


def test_a_rolled_back_offer_is_not_offered(db) -> None:
    q = db.queue("emails")
    with db.sessions() as s, s.begin():
        q.offer(s, "welcome/1", {"user": 1})
        assert_offered(q, s, key="welcome/1")
        s.rollback()
    assert_not_offered(q, db.engine)


def test_assert_offered_says_what_the_queue_holds_instead(db) -> None:
    q = db.queue("emails")
    with db.sessions.begin() as s:
        q.offer(s, "welcome/1", {"user": 1})
    with pytest.raises(AssertionError, match=r"payload=\{'user': 2\}.*'welcome/1': \{'user': 1\}"):
        assert_offered(q, db.engine, key="welcome/1", payload={"user": 2})
    with pytest.raises(AssertionError, match="expected no pending message with key='welcome/1'"):
        assert_not_offered(q, db.engine, key="welcome/1")
    empty = db.queue("empty")
    with pytest.raises(AssertionError, match="has no pending message"):
        assert_offered(empty, db.engine)


def test_dead_and_done_messages_are_not_offered(db) -> None:
    q = db.queue("emails", retention=timedelta(days=1))
    worker = db.worker().register(q, lambda env: None)
    with db.sessions.begin() as s:
        q.offer(s, "a", {"n": 1})
    assert drain(worker).handled == 1
    assert_not_offered(q, db.engine, key="a")


@pytest.mark.parametrize("mode", ["lease", "transactional"])
def test_drain_runs_what_handlers_offer_until_quiet(db, mode: str) -> None:
    orders, emails = db.queue("orders"), db.queue("emails")
    sent: list[str] = []

    def place(env: Any, session: Any = None) -> None:
        def offer(s: Any) -> None:
            emails.offer(s, f"confirm/{env.payload['id']}", env.payload)

        if session is not None:
            offer(session)
        else:
            with db.sessions.begin() as s:
                offer(s)

    worker = db.worker().register(orders, place, mode=mode)
    worker.register(emails, lambda env, session=None: sent.append(env.key), mode=mode)
    with db.sessions.begin() as s:
        for i in range(3):
            orders.offer(s, f"order/{i}", {"id": i})
    result = drain(worker)
    assert result.handled == 6 and result.failures == ()
    assert sorted(sent) == ["confirm/0", "confirm/1", "confirm/2"]
    assert_not_offered(orders, db.engine)
    assert_not_offered(emails, db.engine)


def test_drain_moves_the_clock_through_retries(db) -> None:
    q = db.queue("flaky", retry=NO_JITTER)
    attempts: list[tuple[int, Any]] = []

    def handler(env: Any) -> None:
        attempts.append((env.attempt, q.now()))
        if env.attempt < 3:
            raise RuntimeError(f"attempt {env.attempt} fails")

    worker = db.worker().register(q, handler)
    start = db.clock()
    with db.sessions.begin() as s:
        q.offer(s, "job", {})
    assert drain(worker).handled == 1  # without the clock: the retry is not due yet
    result = drain(worker, clock=db.clock)
    assert result.handled == 2 and len(result.failures) == 1
    assert [a for a, _ in attempts] == [1, 2, 3]
    assert [t - start for _, t in attempts] == [
        timedelta(0),
        timedelta(seconds=10),
        timedelta(seconds=30),
    ]
    assert_not_offered(q, db.engine)


def test_drain_until_stops_time_there(db) -> None:
    q = db.queue("reminders")
    seen: list[str] = []
    worker = db.worker().register(q, lambda env: seen.append(env.key))
    start = db.clock()
    with db.sessions.begin() as s:
        for hours in (1, 2, 30):
            q.offer(s, f"in-{hours}h", {}, at=start + timedelta(hours=hours))
    drain(worker, clock=db.clock, until=start + timedelta(days=1))
    assert seen == ["in-1h", "in-2h"]
    assert db.clock() == start + timedelta(days=1)
    assert_offered(q, db.engine, key="in-30h")


def test_drain_is_bounded(db) -> None:
    q = db.queue("forever")
    counter = iter(range(10**6))

    def again(env: Any) -> None:
        with db.sessions.begin() as s:
            q.offer(s, f"n/{next(counter)}", {})

    worker = db.worker().register(q, again)
    with db.sessions.begin() as s:
        q.offer(s, "start", {})
    with pytest.raises(DrainLimitExceeded, match="more than 20 messages"):
        drain(worker, max_messages=20)


def test_drain_buries_poison_and_can_raise_handler_errors(db) -> None:
    q = db.queue("failing", retry=NO_JITTER)

    def boom(env: Any) -> None:
        raise ValueError("no such customer")

    worker = db.worker().register(q, boom)
    with db.sessions.begin() as s:
        q.offer(s, "x", {})
    with pytest.raises(HandlerFailed, match=r"3 handler call.*failing/x.*no such customer"):
        drain(worker, clock=db.clock, raise_errors=True)
    with db.sessions() as s:
        (dead,) = q.search(s, MessageFilter(state=State.DEAD))
        assert "no such customer" in (dead.last_error or "")


def test_drain_lists_and_can_raise_a_message_a_take_buried_without_a_handler_call(db) -> None:
    """A payload the serializer cannot read is buried by the take: no handler runs, so before
    ``Drained.buried`` a drain reported nothing at all and ``raise_errors`` passed."""
    import sqlalchemy as sa

    from sqla_delayedq import DelayedMessage

    q = db.queue("poison")
    ran: list[str] = []
    worker = db.worker().register(q, lambda env: ran.append(env.key))
    with db.sessions.begin() as s:
        q.offer(s, "bad", {})
        q.offer(s, "good", {})
        t = cast(sa.Table, DelayedMessage.__table__)
        s.execute(sa.update(t).where(t.c.key == "bad").values(payload_type="other"))
    result = drain(worker, clock=db.clock)
    assert ran == ["good"] and result.handled == 1 and result.failures == ()
    ((queue, key, error),) = result.buried
    assert (queue, key) == ("poison", "bad") and "DecodeError" in error
    with db.sessions.begin() as s:
        q.offer(s, "bad2", {})
        s.execute(sa.update(t).where(t.c.key == "bad2").values(payload_type="other"))
    with pytest.raises(
        HandlerFailed, match=r"1 message\(s\) were buried.*poison/bad2.*DecodeError"
    ):
        drain(worker, clock=db.clock, raise_errors=True)
    with inline(worker) as run, db.sessions.begin() as s:
        q.offer(s, "bad3", {})
        s.flush()
        s.execute(sa.update(t).where(t.c.key == "bad3").values(payload_type="other"))
    assert [b.key for b in run.buried] == ["bad3"] and ran == ["good"]


def test_inline_runs_handlers_when_the_offer_commits_never_on_rollback(db) -> None:
    signups, emails = db.queue("signups"), db.queue("emails")
    ran: list[str] = []

    def signup(env: Any) -> None:
        ran.append(env.key)
        with db.sessions.begin() as s:
            emails.offer(s, f"welcome/{env.key}", {})

    worker = db.worker().register(signups, signup)
    worker.register(emails, lambda env: ran.append(env.key))
    with inline(worker) as run:
        with db.sessions() as s:
            with s.begin():
                signups.offer(s, "ann", {})
                assert ran == []  # not before the commit
            assert ran == ["ann", "welcome/ann"]  # as it committed, with what it offered
            with s.begin():
                signups.offer(s, "bob", {})
                s.rollback()
        assert ran == ["ann", "welcome/ann"]
        assert run.handled == 2
    with db.sessions.begin() as s:  # outside the block: back to normal
        signups.offer(s, "cy", {})
    assert ran == ["ann", "welcome/ann"]
    assert_offered(signups, db.engine, key="cy")


def test_manual_clock_use_takes_an_async_queue_as_the_queue_it_wraps(db) -> None:
    from sqla_delayedq.aio import AsyncQueue

    app_queue: DelayedQueue[Any] = DelayedQueue("app")
    wrapped = AsyncQueue(app_queue)
    with db.clock.use(wrapped):
        assert app_queue.now() == db.clock()
    assert app_queue.now() != db.clock()


def test_inline_refuses_a_queue_that_announces_no_offer(db) -> None:
    """A queue built with ``notify=False`` announces no offer in process: the block ran
    nothing, raised nothing, and the test passed with the message still pending (found in
    review)."""
    quiet = db.queue("quiet", notify=False)
    worker = db.worker().register(quiet, lambda env: None)
    refused = pytest.raises(InvalidArgument, match=r"'quiet' were built with notify=False")
    with refused, inline(worker):
        pass


def test_inline_raises_handler_failures_at_the_end_of_the_block(db) -> None:
    q = db.queue("failing", retry=NO_JITTER)

    def boom(env: Any) -> None:
        raise ValueError("smtp down")

    worker = db.worker().register(q, boom)
    with pytest.raises(HandlerFailed, match="smtp down"), inline(worker, raise_errors=True):
        with db.sessions.begin() as s:
            q.offer(s, "x", {})
        # the commit itself returned normally; the retry is scheduled as in production
        assert_offered(q, db.engine, key="x")


def test_drain_async_on_the_asyncio_worker(async_backend) -> None:
    clock = ManualClock()
    q: DelayedQueue[Any] = DelayedQueue("async", clock=clock, retry=NO_JITTER)
    seen: list[int] = []

    async def handler(env: Any) -> None:
        seen.append(env.attempt)
        if env.attempt == 1:
            raise RuntimeError("first try fails")

    async def scenario() -> None:
        worker = AsyncWorker(async_backend.sessions, listen=False).register(q, handler)
        async with async_backend.sessions() as s, s.begin():
            assert isinstance(s, AsyncSession)
            await s.run_sync(lambda sync: q.offer(sync, "a", {}))
        result = await drain_async(worker, clock=clock)
        assert result.handled == 2 and len(result.failures) == 1

    asyncio.run(scenario())
    assert seen == [1, 2]
    assert_not_offered(q, async_backend.sync.engine)
