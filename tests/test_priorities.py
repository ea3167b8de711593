"""Priorities: due messages of a higher priority are taken first, then by schedule and id.

On every backend, in both consumption modes and through the worker: boosted messages first,
highest first; never a message that is not due; aging lets a message due for long enough go
before boosted ones; ``reschedule`` (and the CLI) change a priority; groups still hold. The take
stays index range scans (``tests/test_explain.py``).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from sqla_delayedq import DelayedQueue, InvalidArgument, MessageFilter, Outcome
from sqla_delayedq.testing import ManualClock
from tests.fix_db import Backend

T0 = datetime(2030, 1, 1, tzinfo=UTC)


def keys(envelopes: list[Any]) -> list[str]:
    return [e.key for e in envelopes]


def seeded(backend: Backend, **kw: Any) -> DelayedQueue[Any]:
    """low1, low2 (0), mid (3), high (9), later (9, not due), in that schedule order."""
    q: DelayedQueue[Any] = DelayedQueue("jobs", priorities=True, clock=ManualClock(T0), **kw)
    with backend.Session() as s, s.begin():
        q.offer(s, "low1", {}, T0 - timedelta(minutes=50))
        q.offer(s, "low2", {}, T0 - timedelta(minutes=40))
        q.offer(s, "mid", {}, T0 - timedelta(minutes=30), priority=3)
        q.offer(s, "high", {}, T0 - timedelta(minutes=1), priority=9)
        q.offer(s, "later", {}, T0 + timedelta(minutes=1), priority=9)
    return q


def test_higher_priorities_are_taken_first_then_by_schedule(backend: Backend) -> None:
    q = seeded(backend)
    with backend.Session() as s, s.begin():
        taken = q.try_poll_many(s, 10)
    assert keys(taken) == ["high", "mid", "low1", "low2"]  # "later" is not due
    assert [e.priority for e in taken] == [9, 3, 0, 0]


def test_one_at_a_time_the_order_is_the_same(backend: Backend) -> None:
    q = seeded(backend)
    order = []
    for _ in range(5):
        with backend.Session() as s, s.begin():
            envelope = q.try_poll(s)
            if envelope is None:
                break
            order.append(envelope.key)
    assert order == ["high", "mid", "low1", "low2"]


def test_transactional_takes_honour_priorities(backend: Backend) -> None:
    q = seeded(backend)
    with backend.Session() as s, s.begin():
        assert keys(q.consume(s, 2)) == ["high", "mid"]
    seen: list[str] = []
    while True:
        with backend.Session() as s, s.begin():
            if q.process_one(s, lambda e, session: seen.append(e.key)) is None:
                break
    assert seen == ["low1", "low2"]


def test_aging_lets_a_long_waiting_message_go_first(backend: Backend) -> None:
    q = seeded(backend, priority_aging=timedelta(minutes=45))
    with backend.Session() as s, s.begin():
        # low1 has waited 50 minutes (more than the aging), low2 only 40.
        assert keys(q.try_poll_many(s, 10)) == ["low1", "high", "mid", "low2"]


def test_reschedule_changes_the_priority(backend: Backend) -> None:
    q = seeded(backend)
    with backend.Session() as s, s.begin():
        assert q.reschedule(s, "low2", T0 - timedelta(minutes=40), priority=10) == 1
        assert q.reschedule(s, MessageFilter(keys=("high",)), priority=0) == 1
    with backend.Session() as s, s.begin():
        assert keys(q.try_poll_many(s, 10)) == ["low2", "mid", "low1", "high"]


def test_an_update_stores_the_offers_priority(backend: Backend) -> None:
    q = seeded(backend)
    with backend.Session() as s, s.begin():
        assert q.offer(s, "mid", {"v": 2}, T0 - timedelta(minutes=30)).outcome is Outcome.UPDATED
        q.offer_batch(s, [("low1", {"v": 2}, T0 - timedelta(minutes=50))], priority=7)
        mid, low1 = q.get(s, "mid"), q.get(s, "low1")
        assert mid is not None and low1 is not None and (mid.priority, low1.priority) == (0, 7)


def test_priorities_are_refused_where_they_cannot_work(backend: Backend) -> None:
    plain: DelayedQueue[Any] = DelayedQueue("plain")
    q = seeded(backend)
    with backend.Session() as s, s.begin():
        with pytest.raises(InvalidArgument, match="priorities=True"):
            plain.offer(s, "k", {}, priority=1)
        with pytest.raises(InvalidArgument, match="priorities=True"):
            plain.offer_batch(s, [("k", {})], priority=1)
        bad_priorities: list[tuple[Any, str]] = [
            (-1, "between 0 and 32767"),
            (32768, "between"),
            (1.5, "an int"),
        ]
        for bad, message in bad_priorities:
            with pytest.raises(InvalidArgument, match=message):
                q.offer(s, "k", {}, priority=bad)
            with pytest.raises(InvalidArgument, match=message):
                q.reschedule(s, "low1", priority=bad)
        assert plain.offer(s, "zero", {}, priority=0).outcome is Outcome.CREATED
    with backend.Session() as s:
        assert not plain.contains(s, "k") and not q.contains(s, "k")
    with pytest.raises(InvalidArgument, match="priorities=True"):
        DelayedQueue("x", priority_aging=timedelta(minutes=1))


def test_priorities_and_groups_together(backend: Backend) -> None:
    q: DelayedQueue[Any] = DelayedQueue("jobs", priorities=True, groups=True, clock=ManualClock(T0))
    with backend.Session() as s, s.begin():
        q.offer(s, "a1", {}, T0 - timedelta(minutes=2), group="A")
        q.offer(s, "a2", {}, T0 - timedelta(minutes=1), group="A", priority=9)
        q.offer(s, "b1", {}, T0 - timedelta(minutes=1), priority=5)
    with backend.Session() as s, s.begin():
        # a2's priority does not let it overtake its group's head.
        assert keys(q.try_poll_many(s, 10)) == ["b1", "a1"]


def test_the_worker_takes_boosted_messages_first(backend: Backend, make_worker: Any) -> None:
    from tests.fix_workers import running

    q: DelayedQueue[Any] = DelayedQueue("jobs", priorities=True)
    now = datetime.now(UTC)
    with backend.Session() as s, s.begin():
        q.offer_batch(s, [(f"low{i}", {}, now - timedelta(seconds=60 - i)) for i in range(5)])
        q.offer_batch(
            s, [(f"high{i}", {}, now - timedelta(seconds=5 - i)) for i in range(3)], priority=2
        )
    order: list[str] = []
    worker = make_worker(backend, concurrency=1, poll_interval=0.05)
    worker.register(q, lambda e: order.append(e.key))
    with running(worker):
        deadline = datetime.now(UTC) + timedelta(seconds=30)
        while len(order) < 8 and datetime.now(UTC) < deadline:
            import time

            time.sleep(0.02)
    assert order == ["high0", "high1", "high2", "low0", "low1", "low2", "low3", "low4"]
