"""Ordered delivery per group key: one message of a group in flight at a time, in schedule order.

On every backend and in both consumption modes: a group's head holds the rest back while it is
taken, waiting for a retry or (when the queue says so) dead; other groups and ungrouped messages
are never held back; a lease that runs out gives the head back first. The races with many
processes are in ``tests/test_groups_processes.py``.
"""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_delayedq import DelayedQueue, ExponentialBackoff, InvalidArgument, Outcome
from sqla_delayedq.serializers import JsonSerializer
from sqla_delayedq.testing import ManualClock
from tests.fix_db import Backend
from tests.fix_workers import running
from tests.test_worker import wait_for

T0 = datetime(2030, 1, 1, tzinfo=UTC)


def grouped(clock: ManualClock, **kw: Any) -> DelayedQueue[Any]:
    retry = ExponentialBackoff(max_attempts=2, initial=timedelta(minutes=1), jitter=0)
    return DelayedQueue("orders", groups=True, retry=retry, clock=clock, **kw)


def keys(envelopes: list[Any]) -> list[str]:
    return [e.key for e in envelopes]


def test_one_of_a_group_at_a_time_in_schedule_order(backend: Backend) -> None:
    clock = ManualClock(T0)
    q = grouped(clock)
    with backend.Session() as s, s.begin():
        q.offer(s, "a2", {"n": 2}, T0 - timedelta(seconds=1), group="A")
        q.offer(s, "a1", {"n": 1}, T0 - timedelta(seconds=2), group="A")
        q.offer(s, "b1", {"n": 1}, T0 - timedelta(seconds=3), group="B")
        q.offer(s, "b2", {"n": 2}, T0 - timedelta(seconds=3), group="B")
        q.offer(s, "free1", {}, T0 - timedelta(seconds=5))
        q.offer(s, "free2", {}, T0 - timedelta(seconds=5))
    with backend.Session() as s, s.begin():
        first = q.try_poll_many(s, 10)
    # The heads of A and B (by first schedule, then offer order) and every ungrouped message.
    assert keys(first) == ["free1", "free2", "b1", "a1"]
    assert {e.key: e.group for e in first} == {"free1": None, "free2": None, "b1": "B", "a1": "A"}
    with backend.Session() as s, s.begin():
        assert q.try_poll_many(s, 10) == []  # a1 and b1 in flight hold a2 and b2 back
        by_key = {e.key: e for e in first}
        assert q.ack(s, by_key["a1"])
    with backend.Session() as s, s.begin():
        assert keys(q.try_poll_many(s, 10)) == ["a2"]  # B is still held by b1
        assert q.ack(s, by_key["b1"])
    with backend.Session() as s, s.begin():
        assert keys(q.try_poll_many(s, 10)) == ["b2"]


@pytest.mark.parametrize("dead_blocks", [False, True])
def test_a_failing_head_holds_its_group_until_it_succeeds_or_dies(
    backend: Backend, dead_blocks: bool
) -> None:
    clock = ManualClock(T0)
    q = grouped(clock, dead_blocks_group=dead_blocks)
    with backend.Session() as s, s.begin():
        for i in range(3):
            q.offer(s, f"a{i}", {"n": i}, T0 - timedelta(seconds=10 - i), group="A")
        q.offer(s, "b0", {}, T0 - timedelta(seconds=1), group="B")
    with backend.Session() as s, s.begin():
        a0, b0 = q.try_poll_many(s, 10)
        assert (a0.key, b0.key) == ("a0", "b0")
        q.nack(s, a0, RuntimeError("payment service down"))  # retried in a minute
        q.ack(s, b0)
    with backend.Session() as s, s.begin():
        assert q.try_poll_many(s, 10) == []  # a1 waits behind the retry of a0
    clock.advance(timedelta(minutes=2))
    with backend.Session() as s, s.begin():
        (again,) = q.try_poll_many(s, 10)
        assert (again.key, again.attempt) == ("a0", 2)
        q.nack(s, again, RuntimeError("still down"))  # the last attempt: dead
    with backend.Session() as s, s.begin():
        after_death = keys(q.try_poll_many(s, 10))
    if dead_blocks:
        assert after_death == []
        with backend.Session() as s, s.begin():
            assert q.requeue_dead(s) == 1
        with backend.Session() as s, s.begin():
            (requeued,) = q.try_poll_many(s, 10)
            assert requeued.key == "a0"
            q.ack(s, requeued)
        with backend.Session() as s, s.begin():
            assert keys(q.try_poll_many(s, 10)) == ["a1"]
    else:
        assert after_death == ["a1"]


def test_an_expired_lease_gives_the_head_back_first(backend: Backend) -> None:
    clock = ManualClock(T0)
    q = grouped(clock)
    with backend.Session() as s, s.begin():
        q.offer(s, "a0", {}, T0 - timedelta(seconds=2), group="A")
        q.offer(s, "a1", {}, T0 - timedelta(seconds=1), group="A")
    with backend.Session() as s, s.begin():
        (first,) = q.try_poll_many(s, 10, lease=timedelta(seconds=30))
    clock.advance(timedelta(seconds=31))
    with backend.Session() as s, s.begin():
        (again,) = q.try_poll_many(s, 10)
        assert (again.key, again.redelivered) == ("a0", True)
        assert not q.ack(s, first)  # the first consumer's lease is gone
        assert q.ack(s, again)
    with backend.Session() as s, s.begin():
        assert keys(q.try_poll_many(s, 10)) == ["a1"]


def test_transactional_takes_keep_the_group_order(backend: Backend) -> None:
    clock = ManualClock(T0)
    q = grouped(clock)
    with backend.Session() as s, s.begin():
        q.offer_batch(
            s, [(f"a{i}", {"n": i}, T0 - timedelta(seconds=9 - i)) for i in range(3)], group="A"
        )
        q.offer_batch(
            s, [(f"b{i}", {"n": i}, T0 - timedelta(seconds=9 - i)) for i in range(2)], group="B"
        )
    with backend.Session() as s, s.begin():
        assert keys(q.consume(s, 10)) == ["a0", "b0"]
        s.rollback()  # a rollback gives the heads back, still heads
    with backend.Session() as s, s.begin():
        failed = q.process_one(s, lambda e, session: 1 / 0)
        assert failed is not None and failed[0].key == "a0" and failed[1] is not None
    with backend.Session() as s, s.begin():
        assert keys(q.consume(s, 10)) == ["b0"]  # a0 waits for its retry; a1 behind it
    clock.advance(timedelta(minutes=2))
    order: list[str] = []
    while True:
        with backend.Session() as s, s.begin():
            done = q.process_one(s, lambda e, session: order.append(e.key))
        if done is None:
            break
    assert order == ["b1", "a0", "a1", "a2"]  # by due time, each group in its order


@pytest.mark.parametrize("case", ["priorities", "aging", "burial"])
def test_a_transactional_batch_takes_one_message_per_group(backend: Backend, case: str) -> None:
    """``consume(n)`` may run several statements in its transaction (one per priority probe,
    another round after burying an undecodable row); the rows the first one deleted must still
    hold their groups back from the next."""
    clock = ManualClock(T0)
    kw: dict[str, Any] = {"groups": True, "clock": clock}
    if case != "burial":
        kw["priorities"] = True
    if case == "aging":
        kw["priority_aging"] = timedelta(minutes=30)
    q: DelayedQueue[Any] = DelayedQueue("batch", **kw)
    with backend.Session() as s, s.begin():
        if case == "priorities":  # the boosted head, then its group's next at priority 0
            q.offer(s, "a1", {"n": 1}, T0 - timedelta(seconds=2), group="A", priority=5)
            q.offer(s, "a2", {"n": 2}, T0 - timedelta(seconds=1), group="A")
        elif case == "aging":  # the aged head at priority 0, its next boosted
            q.offer(s, "a1", {"n": 1}, T0 - timedelta(minutes=45), group="A")
            q.offer(s, "a2", {"n": 2}, T0 - timedelta(minutes=1), group="A", priority=9)
        else:  # a row this queue cannot decode: buried, and the take goes round again
            q.offer(s, "a1", {"n": 1}, T0 - timedelta(seconds=3), group="A")
            q.offer(s, "a2", {"n": 2}, T0 - timedelta(seconds=2), group="A")
            other = DelayedQueue("batch", serializer=JsonSerializer("v2"), **kw)
            other.offer(s, "poison", {}, T0 - timedelta(seconds=1))
    with backend.Session() as s, s.begin():
        assert keys(q.consume(s, 10)) == ["a1"]
    with backend.Session() as s, s.begin():
        assert keys(q.consume(s, 10)) == ["a2"]


def test_a_batch_of_one_group_is_delivered_in_the_order_it_was_offered(backend: Backend) -> None:
    """A batch inserted its keys sorted, so a group's events due at one time went in key order
    (``delivered`` before ``paid``), and with generated keys in a random one (found in
    review). A grouped batch keeps its input order, as single offers do."""
    clock = ManualClock(T0)
    q = grouped(clock)
    events = ["order-7/paid", "order-7/packed", "order-7/shipped", "order-7/delivered"]
    with backend.Session() as s, s.begin():
        q.offer_batch(s, [(k, {"e": k}) for k in events], group="order-7")
        q.offer_batch(s, [(None, {"step": i}, None, "generated") for i in range(6)])
    order: list[Any] = []
    while True:
        with backend.Session() as s, s.begin():
            taken = q.try_poll_many(s, 10)
            if not taken:
                break
            for envelope in taken:
                order.append(envelope.payload.get("e", envelope.payload.get("step")))
                assert q.ack(s, envelope)
    assert [x for x in order if isinstance(x, str)] == events
    assert [x for x in order if isinstance(x, int)] == list(range(6))


def test_an_update_keeps_the_messages_group(backend: Backend) -> None:
    clock = ManualClock(T0)
    q = grouped(clock)
    with backend.Session() as s, s.begin():
        q.offer(s, "k", {"v": 1}, group="A")
        assert q.offer(s, "k", {"v": 2}, group="B").outcome is Outcome.UPDATED
        q.offer_batch(s, [("k", {"v": 3})], group="C")
        info = q.get(s, "k")
        assert info is not None and (info.group, info.payload) == ("A", {"v": 3})


def test_groups_are_refused_where_they_cannot_work(backend: Backend) -> None:
    plain: DelayedQueue[Any] = DelayedQueue("plain")
    with backend.Session() as s, s.begin():
        plain.offer(s, "kept", {})
        with pytest.raises(InvalidArgument, match="groups=True"):
            plain.offer(s, "k", {}, group="A")
        with pytest.raises(InvalidArgument, match="groups=True"):
            plain.offer_batch(s, [("k2", {})], group="A")
        q = grouped(ManualClock(T0))
        bad_groups: list[tuple[Any, str]] = [("", "empty"), ("x" * 201, "limit is 200"), (7, "str")]
        for bad, message in bad_groups:
            with pytest.raises(InvalidArgument, match=message):
                q.offer(s, "k3", {}, group=bad)
    with backend.Session() as s:
        assert plain.contains(s, "kept") and not plain.contains(s, "k")
    with pytest.raises(InvalidArgument, match="groups=True"):
        DelayedQueue("x", dead_blocks_group=True)


def test_a_grouped_take_refuses_repeatable_read_on_mariadb(mariadb: Backend) -> None:
    """Under InnoDB's REPEATABLE READ the head probe could read a snapshot older than the locking
    pick and miss a pending message of the group: refused with a clear error, nothing taken."""
    import sqlalchemy as sa
    from sqlalchemy.orm import Session

    from sqla_delayedq import DelayedQueueError

    q = grouped(ManualClock(T0))
    plain: DelayedQueue[Any] = DelayedQueue("plain", clock=ManualClock(T0))
    with mariadb.Session() as s, s.begin():
        q.offer(s, "a0", {}, T0, group="A")
        plain.offer(s, "p0", {}, T0)
    engine = sa.create_engine(mariadb.url, isolation_level="REPEATABLE READ", poolclass=sa.NullPool)
    try:
        with Session(engine) as s, s.begin():
            with pytest.raises(DelayedQueueError, match="READ COMMITTED"):
                q.try_poll(s)
            with pytest.raises(DelayedQueueError, match="READ COMMITTED"):
                q.consume(s)
            assert plain.try_poll(s) is not None  # queues without groups are not affected
    finally:
        engine.dispose()
    with mariadb.Session() as s, s.begin():
        assert keys(q.try_poll_many(s, 10)) == ["a0"]  # READ COMMITTED: taken


def test_a_worker_takes_the_next_of_a_group_at_once_after_settling_its_head(
    backend: Backend, make_worker: Any
) -> None:
    """One consumer, a long poll interval: after acknowledging a group's head, the worker takes
    the next message of the group at once instead of sleeping until the poll interval (the
    take that found the head saw nothing more due: the rest was behind it)."""
    import time

    from tests.fix_workers import running

    q: DelayedQueue[Any] = DelayedQueue("orders", groups=True)
    with backend.Session() as s, s.begin():
        q.offer_batch(s, [(f"a{i}", {}, None, "A") for i in range(5)])
    started: list[float] = []
    worker = make_worker(backend, concurrency=1, poll_interval=30, listen=False)
    worker.register(q, lambda e: started.append(time.monotonic()))
    with running(worker):
        deadline = time.monotonic() + 20
        while len(started) < 5 and time.monotonic() < deadline:
            time.sleep(0.02)
    assert len(started) == 5  # without the rule each would wait for the 30 s poll interval


def test_a_worker_takes_the_next_of_each_group_at_once_between_groups(
    backend: Backend, make_worker: Any
) -> None:
    """One consumer, a long poll interval, two groups: the takes that follow an acknowledgement
    alternate between the groups (on PostgreSQL one statement acknowledges and takes, in a
    snapshot where the acknowledged message is still in flight), and when such a take finds
    nothing the worker still takes again at once: the acknowledged message's successor waits."""
    import time

    from tests.fix_workers import running

    q: DelayedQueue[Any] = DelayedQueue("orders", groups=True)
    with backend.Session() as s, s.begin():
        q.offer_batch(s, [(f"{g}{i}", {}, None, g) for i in range(5) for g in "AB"])
    started: list[str] = []
    worker = make_worker(backend, concurrency=1, poll_interval=30, listen=False)
    worker.register(q, lambda e: started.append(e.key))
    with running(worker):
        deadline = time.monotonic() + 20
        while len(started) < 10 and time.monotonic() < deadline:
            time.sleep(0.02)
    assert sorted(started) == sorted(f"{g}{i}" for i in range(5) for g in "AB"), started
    for g in "AB":
        assert [k for k in started if k[0] == g] == [f"{g}{i}" for i in range(5)]


def lease_others(backend: Backend, n: int) -> None:
    """``n`` messages of another queue under leases whose tokens sort before any a take gives:
    a grouped take's first read of the table's leases (128 of them, by token) misses the rest."""
    other = DelayedQueue[Any]("other")
    with backend.Session() as s, s.begin():
        other.offer_batch(s, [(f"x{i}", {}) for i in range(n)])
    t = other.shape.table
    with backend.engine.begin() as conn:
        conn.execute(
            t.update()
            .where(t.c.queue == "other")
            .values(
                lock_token=sa.literal("00000000.") + sa.cast(t.c.id, sa.String),
                scheduled_at=T0 + timedelta(hours=1),
            )
        )


@pytest.mark.parametrize("others", [0, 200], ids=["alone", "beside 200 leases"])
def test_a_message_back_dated_before_a_taken_one_waits_for_it_leased(
    backend: Backend, others: int
) -> None:
    """A late event offered with an earlier time than its group's message in flight goes
    first in the group's order, but does not start beside it: the group is busy until the
    taken message is settled (or its lease runs out). Beside 200 leases of another queue, the
    take's first read of the leases misses the group's, and its own probe finds it."""
    clock = ManualClock(T0)
    q = grouped(clock)
    lease_others(backend, others)
    with backend.Session() as s, s.begin():
        q.offer(s, "a1", {}, T0 - timedelta(seconds=1), group="A")
    with backend.Session() as s, s.begin():
        (a1,) = q.try_poll_many(s, 10, lease=timedelta(seconds=30))
    with backend.Session() as s, s.begin():
        q.offer(s, "a0", {}, T0 - timedelta(seconds=5), group="A")
        q.offer(s, "b0", {}, T0 - timedelta(seconds=5), group="B")
    with backend.Session() as s, s.begin():
        assert keys(q.try_poll_many(s, 10)) == ["b0"]  # a1 still runs: a0 waits
    with backend.Session() as s, s.begin():
        assert q.ack(s, a1)
    with backend.Session() as s, s.begin():
        assert keys(q.try_poll_many(s, 10)) == ["a0"]


def test_a_message_back_dated_before_a_lost_lease_is_taken_when_the_lease_runs_out(
    backend: Backend,
) -> None:
    clock = ManualClock(T0)
    q = grouped(clock)
    with backend.Session() as s, s.begin():
        q.offer(s, "a1", {}, T0 - timedelta(seconds=1), group="A")
    with backend.Session() as s, s.begin():
        q.try_poll_many(s, 10, lease=timedelta(seconds=30))
    with backend.Session() as s, s.begin():
        q.offer(s, "a0", {}, T0 - timedelta(seconds=5), group="A")
    with backend.Session() as s, s.begin():
        assert q.try_poll_many(s, 10) == []
    clock.advance(timedelta(seconds=31))  # the consumer of a1 is presumed dead
    with backend.Session() as s, s.begin():
        assert keys(q.try_poll_many(s, 10)) == ["a0"]  # the group's order again


def test_a_message_back_dated_before_a_taken_one_waits_for_it_transactional(
    server_backend: Backend,
) -> None:
    """The transactional take of a1 holds it in a transaction that is still open; a0, offered
    meanwhile with an earlier time, is not taken until that transaction ends. (SQLite has one
    writer: the open take holds every other take back.)"""
    backend = server_backend
    clock = ManualClock(T0)
    q = grouped(clock)
    with backend.Session() as s, s.begin():
        q.offer(s, "a1", {}, T0 - timedelta(seconds=1), group="A")
    with backend.Session() as holder, holder.begin():
        assert keys(q.consume(holder, 10)) == ["a1"]
        with backend.Session() as s, s.begin():
            q.offer(s, "a0", {}, T0 - timedelta(seconds=5), group="A")
            q.offer(s, "b0", {}, T0 - timedelta(seconds=5), group="B")
        with backend.Session() as s, s.begin():
            assert keys(q.consume(s, 10)) == ["b0"]  # a1 is in flight: a0 waits
        with backend.Session() as s, s.begin():
            assert keys(q.try_poll_many(s, 10)) == []  # nor does a lease take it
    with backend.Session() as s, s.begin():
        assert keys(q.consume(s, 10)) == ["a0"]


def test_a_transactional_take_gives_its_group_back_when_it_rolls_back(
    server_backend: Backend,
) -> None:
    """The group stays held only while the take's transaction is open (on MariaDB the named
    lock of the group is given back at the rollback, on the same pooled connection)."""
    clock = ManualClock(T0)
    q = grouped(clock)
    with server_backend.Session() as s, s.begin():
        q.offer(s, "a1", {}, T0 - timedelta(seconds=1), group="A")
    for _ in range(3):
        with server_backend.Session() as holder, holder.begin():
            assert keys(q.consume(holder, 10)) == ["a1"]
            holder.rollback()
        with server_backend.Session() as holder:
            holder.begin()
            assert keys(q.try_poll_many(holder, 10)) == ["a1"]
            holder.close()  # ends the transaction without a commit
        with server_backend.Session() as s, s.begin():
            (again,) = q.try_poll_many(s, 10)
            assert again.key == "a1"
            assert q.release(s, again)


def test_an_update_of_a_head_in_flight_keeps_its_group_busy(backend: Backend) -> None:
    """A keyed offer that updates a group's head while its handler runs: the head stays in flight
    (held for the old delivery), so the group's next message still waits."""
    clock = ManualClock(T0)
    q = grouped(clock)
    with backend.Session() as s, s.begin():
        q.offer(s, "a1", {"v": 1}, T0 - timedelta(seconds=2), group="A")
        q.offer(s, "a2", {"v": 1}, T0 - timedelta(seconds=1), group="A")
    with backend.Session() as s, s.begin():
        [a1] = q.try_poll_many(s, 10)
    with backend.Session() as s, s.begin():
        assert q.offer(s, "a1", {"v": 2}, T0 + timedelta(minutes=1)).outcome is Outcome.UPDATED
    with backend.Session() as s, s.begin():
        assert q.try_poll_many(s, 10) == []  # a1's old handler still runs
        assert q.consume(s, 10) == []
    with backend.Session() as s, s.begin():
        assert not q.ack(s, a1)  # the old delivery ends: a2 is next (a1 is due in a minute)
    with backend.Session() as s, s.begin():
        [a2] = q.try_poll_many(s, 10)
        assert a2.key == "a2" and q.ack(s, a2)
    clock.advance(timedelta(minutes=1))
    with backend.Session() as s, s.begin():
        [again] = q.try_poll_many(s, 10)
        assert again.key == "a1" and again.payload == {"v": 2}


@pytest.mark.parametrize("mode", ["lease", "transactional"])
def test_a_worker_never_runs_two_of_a_group_when_a_head_is_replaced_in_flight(
    server_backend: Backend, make_worker: Any, mode: str
) -> None:
    """The race for real: a1's handler runs when a producer replaces a1; a2 (same group) must not
    start until a1's old handler has finished. Handlers count how many of the group run."""
    q: DelayedQueue[Any] = DelayedQueue("replaced-heads", groups=True)
    now = datetime.now(UTC)
    with server_backend.Session() as s, s.begin():
        q.offer(s, "a1", {"v": 1}, now - timedelta(seconds=2), group="A")
        q.offer(s, "a2", {"v": 1}, now - timedelta(seconds=1), group="A")
    lock = threading.Lock()
    running_now, peak, log = [0], [0], []
    started = threading.Event()

    def handler(env: Any, *session: Any) -> None:
        with lock:
            running_now[0] += 1
            peak[0] = max(peak[0], running_now[0])
            log.append(("start", env.key, env.payload["v"]))
        if env.key == "a1" and env.payload["v"] == 1:
            started.set()
            time.sleep(1.0)
        with lock:
            running_now[0] -= 1
            log.append(("end", env.key, env.payload["v"]))

    worker = make_worker(server_backend, concurrency=4, poll_interval=0.05, listen=False)
    worker.register(q, handler, mode=mode)
    with running(worker):
        assert started.wait(30)
        with server_backend.Session() as s, s.begin():
            q.offer(s, "a1", {"v": 2}, datetime.now(UTC) + timedelta(seconds=1))
        assert wait_for(lambda: len(log) >= 6, 30)
    assert peak[0] == 1, log
    assert log[:2] == [("start", "a1", 1), ("end", "a1", 1)]
    assert sorted(log[2:]) == [
        ("end", "a1", 2),
        ("end", "a2", 1),
        ("start", "a1", 2),
        ("start", "a2", 1),
    ]
