"""Depth read with a bound (issue 19): ``counts(at_most=N)`` and ``queue_stats(at_most=N)``.

On every backend: below the cap a bounded read equals the exact one; above it each count stops
at the cap and says so (``capped``); dead and done share one read and are capped together; the
leases of every queue are read together; the exact read is unchanged by default; one statement
per read (per queue on PostgreSQL). The plans are in
``test_explain.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import timedelta
from typing import Any, cast

import pytest
import sqlalchemy as sa

from sqla_delayedq import DelayedMessage, DelayedQueue, ExponentialBackoff, QueueCounts
from sqla_delayedq import _cli_stats as stats
from sqla_delayedq._dialects import strategy_for
from sqla_delayedq.aio import AsyncQueue
from sqla_delayedq.errors import InvalidArgument
from tests.fix_db import AsyncBackend, Backend
from tests.fix_queue import FakeClock, record_sql

T = cast(sa.Table, DelayedMessage.__table__)
MakeQueue = Callable[..., DelayedQueue[Any]]
#: What :func:`fill` leaves in the queue.
FILLED = QueueCounts(due=7, scheduled=6, in_flight=5, dead=4, done=0)


def fill(backend: Backend, q: DelayedQueue[Any], clock: FakeClock) -> None:
    """7 due, 6 scheduled, 5 in flight, 4 dead (``q`` allows one attempt)."""
    now = clock()
    with backend.Session() as s, s.begin():
        q.offer_batch(s, [(f"dead/{i}", {}, now - timedelta(seconds=60)) for i in range(4)])
    with backend.Session() as s, s.begin():
        for env in q.try_poll_many(s, 4):
            q.nack(s, env, "boom")
    with backend.Session() as s, s.begin():
        q.offer_batch(s, [(f"flight/{i}", {}, now - timedelta(seconds=30)) for i in range(5)])
    with backend.Session() as s, s.begin():
        assert len(q.try_poll_many(s, 5, lease=timedelta(hours=1))) == 5
    with backend.Session() as s, s.begin():
        q.offer_batch(s, [(f"due/{i}", {}, now - timedelta(seconds=i)) for i in range(7)])
        q.offer_batch(s, [(f"later/{i}", {}, now + timedelta(minutes=i + 1)) for i in range(6)])


def selects(sent: list[str]) -> list[str]:
    """The queries among the statements sent (SQLite's engine sends ``BEGIN`` too)."""
    return [sql for sql in sent if sql.lstrip().upper().startswith("SELECT")]


def one_attempt(make_queue: MakeQueue, name: str = "depth", **kwargs: Any) -> DelayedQueue[Any]:
    return make_queue(name, retry=ExponentialBackoff(max_attempts=1), **kwargs)


def test_exact_counts_are_the_default(
    backend: Backend, make_queue: MakeQueue, clock: FakeClock
) -> None:
    q = one_attempt(make_queue)
    fill(backend, q, clock)
    with backend.Session() as s:
        counts = q.counts(s)
        (row,) = stats.queue_stats(s, T, clock())
    assert counts == FILLED and counts.exact and counts.capped == frozenset()
    assert (row.due, row.scheduled, row.in_flight, row.dead, row.done) == (7, 6, 5, 4, 0)
    assert row.exact and row.as_dict()["capped"] == []


def test_bounded_counts_equal_exact_counts_up_to_the_cap(
    backend: Backend, make_queue: MakeQueue, clock: FakeClock
) -> None:
    """Every count at or below ``at_most`` is exact, and not flagged (7 due, at_most=7)."""
    q = one_attempt(make_queue)
    fill(backend, q, clock)
    with backend.Session() as s:
        assert q.counts(s, at_most=7) == FILLED
        assert q.counts(s, at_most=1000) == FILLED
        exact = stats.queue_stats(s, T, clock())
        assert stats.queue_stats(s, T, clock(), at_most=7) == exact


def test_a_count_above_the_cap_stops_there_and_says_so(
    backend: Backend, make_queue: MakeQueue, clock: FakeClock
) -> None:
    q = one_attempt(make_queue)
    fill(backend, q, clock)
    with backend.Session() as s:
        five = q.counts(s, at_most=5)
        four = q.counts(s, at_most=4)
        three = q.counts(s, at_most=3)
    assert five == QueueCounts(5, 5, 5, 4, 0, capped=frozenset({"due", "scheduled"}))
    assert four == QueueCounts(4, 4, 4, 4, 0, capped=frozenset({"due", "scheduled", "in_flight"}))
    assert not five.exact and five.pending == 15
    # Dead and done share one read (rows without a schedule): capped together.
    assert three == QueueCounts(3, 3, 3, 3, 0, capped=frozenset(stats.STATES))


def test_the_leases_of_every_queue_are_read_together(
    backend: Backend, make_queue: MakeQueue, clock: FakeClock
) -> None:
    """One read of at most at_most + 1 leases serves every queue: 3 + 3 in flight with
    at_most=4 caps both queues' counts in flight, each a lower bound."""
    a, b = make_queue("a"), make_queue("b")
    for q in (a, b):
        with backend.Session() as s, s.begin():
            q.offer_batch(s, [(f"k{i}", {}, clock() - timedelta(seconds=1)) for i in range(3)])
        with backend.Session() as s, s.begin():
            assert len(q.try_poll_many(s, 3, lease=timedelta(hours=1))) == 3
    with backend.Session() as s:
        assert a.counts(s, at_most=6) == QueueCounts(0, 0, 3, 0, 0)
        capped = [q.counts(s, at_most=4) for q in (a, b)]
        both = stats.queue_stats(s, T, clock(), ["a", "b"], at_most=4)
    assert all(c.capped == {"in_flight"} and c.in_flight <= 3 for c in capped)
    assert [(q.capped, q.in_flight <= 3) for q in both] == [(frozenset({"in_flight"}), True)] * 2
    assert sum(q.in_flight for q in both) == 5  # the first five leases, by token


def test_dead_and_done_are_capped_together(
    backend: Backend, make_queue: MakeQueue, clock: FakeClock
) -> None:
    """2 dead and 3 done (kept by retention): 5 rows without a schedule, one read for both."""
    q = one_attempt(make_queue, retention=timedelta(days=1))
    now = clock()
    with backend.Session() as s, s.begin():
        q.offer_batch(s, [(f"k{i}", {}, now - timedelta(seconds=10 - i)) for i in range(5)])
    with backend.Session() as s, s.begin():
        envs = q.try_poll_many(s, 5)
        for env in envs[:2]:
            q.nack(s, env, "boom")
        q.ack_many(s, envs[2:])
    both = frozenset({"dead", "done"})
    with backend.Session() as s:
        assert q.counts(s, at_most=5) == QueueCounts(0, 0, 0, 2, 3)
        assert q.counts(s, at_most=4) == QueueCounts(0, 0, 0, 2, 3, capped=both)
        first_three = q.counts(s, at_most=2)
    # Three rows read, each count a lower bound of its own and at most the cap.
    assert first_three.capped == both
    assert first_three.dead <= 2 and first_three.done <= 2
    assert first_three.dead + first_three.done >= 2


def test_bounded_stats_keep_the_lag_and_report_every_queue(
    backend: Backend, make_queue: MakeQueue, clock: FakeClock
) -> None:
    fill(backend, one_attempt(make_queue), clock)
    with backend.Session() as s, s.begin():
        make_queue("other").offer(s, "x", {}, clock() - timedelta(seconds=3))
    names = ["depth", "other", "idle"]
    with backend.Session() as s:
        exact = stats.queue_stats(s, T, clock(), names, include_missing=True)
        bounded = stats.queue_stats(s, T, clock(), names, include_missing=True, at_most=5)
        left_out = stats.queue_stats(s, T, clock(), ["idle"], at_most=5)
        # 5 leases in the table, 2 read: any queue may hold the others, "idle" included.
        unsure = stats.queue_stats(s, T, clock(), ["idle"], at_most=1)
    assert [b.queue for b in bounded] == ["depth", "idle", "other"]
    assert [(b.oldest_due, b.lag_seconds) for b in bounded] == [
        (e.oldest_due, e.lag_seconds) for e in exact
    ]
    assert bounded[0].lag_seconds == 6.0  # due/6
    assert (bounded[1].pending, bounded[1].capped) == (0, frozenset())
    assert (bounded[2].due, bounded[2].capped) == (1, frozenset())
    assert left_out == []
    assert [(u.queue, u.pending, u.capped) for u in unsure] == [
        ("idle", 0, frozenset({"in_flight"}))
    ]


def test_a_bounded_read_is_one_statement_per_queue_at_most(
    backend: Backend, make_queue: MakeQueue, clock: FakeClock
) -> None:
    """One for all three queues on SQLite and MariaDB; one per queue on PostgreSQL."""
    fill(backend, one_attempt(make_queue), clock)
    with backend.Session() as s:
        with record_sql(backend.engine) as sent:
            stats.queue_stats(s, T, clock(), ["depth", "a", "b"], at_most=3)
        assert len(selects(sent)) == (3 if backend.name == "postgresql" else 1), sent
        with record_sql(backend.engine) as sent:
            one_attempt(make_queue).counts(s, at_most=3)
        assert len(selects(sent)) == 1, sent


def test_many_queues_are_read_in_chunks(
    backend: Backend, make_queue: MakeQueue, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hundred queues per statement (SQLite allows 500 selects in one compound statement),
    one on PostgreSQL (JIT): here two, so five queues take three statements."""
    names = [f"q{i}" for i in range(5)]
    with backend.Session() as s, s.begin():
        for i, name in enumerate(names):
            make_queue(name).offer_batch(s, [(f"k{j}", {}) for j in range(i + 1)])
    with backend.Session() as s:
        strategy = type(strategy_for(s))
        assert strategy.queues_per_bounded_stats == (1 if backend.name == "postgresql" else 100)
        monkeypatch.setattr(strategy, "queues_per_bounded_stats", 2)
        with record_sql(backend.engine) as sent:
            bounded = stats.queue_stats(s, T, clock(), names, at_most=3)
    assert len(selects(sent)) == 3
    assert [(b.queue, b.due, b.capped) for b in bounded] == [
        ("q0", 1, frozenset()),
        ("q1", 2, frozenset()),
        ("q2", 3, frozenset()),
        ("q3", 3, frozenset({"due"})),
        ("q4", 3, frozenset({"due"})),
    ]


def test_at_most_must_be_positive(backend: Backend, make_queue: MakeQueue) -> None:
    with backend.Session() as s, pytest.raises(InvalidArgument, match="at_most must be >= 1"):
        make_queue("q").counts(s, at_most=0)


def test_async_counts_take_at_most(async_backend: AsyncBackend, make_queue: MakeQueue) -> None:
    q = make_queue("aq")
    with async_backend.sync.Session() as s, s.begin():
        q.offer_batch(s, [(f"k{i}", {}, q.now() - timedelta(seconds=1)) for i in range(3)])
    aq = AsyncQueue(q)

    async def scenario() -> tuple[QueueCounts, QueueCounts]:
        async with async_backend.sessions() as s:
            return await aq.counts(s), await aq.counts(s, at_most=2)

    exact, bounded = asyncio.run(scenario())
    assert exact == QueueCounts(3, 0, 0, 0, 0)
    assert bounded == QueueCounts(2, 0, 0, 0, 0, capped=frozenset({"due"}))
